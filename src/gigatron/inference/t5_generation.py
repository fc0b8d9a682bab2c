"""T5 generation: the encoder runs once per batch; the decoder feeds one token per step over a
cache of its self-attention keys and values and of the cross-attention keys and values of the
encoder output (computed at the first step, reused by every later one).

Greedy decoding (temperature 0), as `T5ForConditionalGeneration.generate(do_sample=False)`, or
sampling (temperature, top-k, top-p, a seed per row) with the GPT engine's vocab-parallel
`sampling.choose_tokens` (Gumbel-max: the same token for the same seed at any tp size): the
decoder starts from `decoder_start_id` (the tokenizer's BOS, Hugging Face's pad token 0) and a
row ends at `eos_id` (not included in its tokens) or after `max_tokens`. Every rank runs the same
steps; the model must hold both stacks on one pipeline stage.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.inference.sampling import RowSampling, choose_tokens, mask_vocabulary
from gigatron.parallel.context import ParallelContext


class T5DecoderCache:
    """What attention takes as `inference_cache` during T5 decoding: `update` appends a step's
    self-attention keys and values [s, b, groups, hn] to the layer's; `attention_mask_for`
    gives the step's mask (set by `T5Model.decode`); `cross_keys_values` the layer's
    cross-attention keys and values of `memory`, computed once."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.self_mask: torch.Tensor | None = None

    def update(
        self, layer_number: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_number in self.keys:
            k = torch.cat([self.keys[layer_number], k])
            v = torch.cat([self.values[layer_number], v])
        self.keys[layer_number], self.values[layer_number] = k, v
        return k, v

    def attention_mask_for(self, core_attention: nn.Module) -> torch.Tensor | None:
        return self.self_mask

    def cross_keys_values(
        self, layer_number: int, cross_attention: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_number not in self.cross:
            self.cross[layer_number] = cross_attention.keys_values(self.memory)
        return self.cross[layer_number]

    def cached_positions(self) -> int:
        """Decoder positions held (0 before the first step)."""
        first = next(iter(self.keys.values()), None)
        return 0 if first is None else first.shape[0]


@dataclasses.dataclass
class T5Completion:
    output_ids: list[int]
    finish_reason: str  # "stop" (eos) or "length"


def _padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [b, s] and their padding mask (1 = real token)."""
    width = max(len(ids) for ids in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        mask[row, : len(prompt)] = 1
    return ids, mask


@torch.no_grad()
def t5_generate(
    model: nn.Module,
    pctx: ParallelContext,
    prompts: list[list[int]],
    max_tokens: int,
    decoder_start_id: int,
    eos_id: int | None,
    vocab_size: int,
    sampling: list[RowSampling] | None = None,
) -> list[T5Completion]:
    """Continuations of encoder prompts (see the module docstring); `vocab_size`: the
    tokenizer's (padded vocabulary entries are never chosen); `sampling`: how each row picks its
    tokens (default greedy; each row's `step` is set here)."""
    if not (getattr(model, "add_encoder", False) and getattr(model, "add_decoder", False)):
        raise GigatronError(
            "T5 generation: this rank holds only part of the model (pipeline-parallel); convert "
            "the checkpoint to pipeline-parallel size 1 with gigatron convert-checkpoint"
        )
    if any(not ids for ids in prompts):
        raise GigatronError("T5 generation: an empty prompt; the encoder needs at least one token")
    table = model.embedding.position_embeddings  # None with relative positions
    longest = max(max(map(len, prompts)), max_tokens)
    if table is not None and longest > table.num_embeddings:
        raise GigatronError(
            f"T5 generation: {longest} positions (the longest prompt, or --max-tokens) but the "
            f"model has {table.num_embeddings} learned positions; shorten the prompt or lower "
            "--max-tokens"
        )
    device = next(model.parameters()).device
    enc_ids, enc_mask = _padded(prompts, 0, device)
    cache = T5DecoderCache(model.encode(enc_ids, enc_mask))
    tokens = torch.full((len(prompts), 1), decoder_start_id, dtype=torch.long, device=device)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    rows = sampling or [RowSampling(temperature=0.0)] * len(prompts)
    for step in range(max_tokens):
        logits = model.decode(tokens, step, cache.memory, enc_mask, cache)[:, -1].float()
        now = [dataclasses.replace(row, step=step) for row in rows]
        chosen = choose_tokens(mask_vocabulary(logits, vocab_size, pctx), now, pctx, vocab_size)
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                continue
            if token == eos_id:
                done[row] = True
            else:
                outputs[row].append(token)
        if all(done):
            break
        tokens = chosen.view(-1, 1).to(torch.long)
    return [
        T5Completion(ids, "stop" if finished else "length") for ids, finished in zip(outputs, done)
    ]


def refuse_unsupported(params, args) -> None:
    """T5 generation has no stop strings or log-probs: refuse flags asking for them."""
    asked = {
        "--stop": bool(params.stop),
        "--stop-on-eol / --stop-on-double-eol": params.stop_on_eol or params.stop_on_double_eol,
        "--logprobs / --prompt-logprobs / --top-logprobs": bool(
            params.logprobs or params.prompt_logprobs or params.top_logprobs
        ),
        "--inference-dynamic-batching": bool(getattr(args, "inference_dynamic_batching", False)),
        "--add-bos": bool(getattr(args, "add_bos", False)),
        "--num-speculative-tokens": bool(getattr(args, "num_speculative_tokens", 0)),
        "--speculative-draft-load": bool(getattr(args, "speculative_draft_load", None)),
        "--max-sequence-length": getattr(args, "max_sequence_length", None) is not None,
    }
    refused = [flag for flag, given in asked.items() if given]
    if refused:
        raise GigatronError(f"{', '.join(refused)}: not available for a T5 checkpoint; drop them")


def special_ids(tokenizer) -> tuple[int, int | None]:
    """(decoder start, end token): the tokenizer's BOS, else its pad (Hugging Face T5's decoder
    start), else 0; its EOS, else its end of document."""
    start = next((t for t in (tokenizer.bos, getattr(tokenizer, "pad", None)) if t is not None), 0)
    eos = getattr(tokenizer, "eos", None)
    return start, eos if eos is not None else tokenizer.eod
