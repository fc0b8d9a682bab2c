"""Speculative decoding with the model's own multi-token-prediction heads (`--mtp-num-layers`,
models/mtp.py; Megatron's `--num-speculative-tokens K`, K <= the MTP depths).

Each round the MTP heads draft K tokens (depth k at the last verified position takes the
previous depth's hidden state and the embedding of the token k ahead, the draft of depth k - 1
for k > 1), then one forward of the main model over the pending token and the K drafts verifies
them all: draft j is accepted with probability min(1, p_j(d) / q_j(d)) (p: the main model's
distribution, q: the head's), the first rejection is replaced by a token drawn from
norm(max(0, p_j - q_j)), and when all are accepted one more token is drawn from p_K. This keeps
the main model's sampling distribution exactly; at temperature 0 both distributions are one-hot,
so the tokens are exactly the non-speculative greedy ones.

Keys and values live in one static `KVCache` (slot 0) holding the decoder's layers and the MTP
layers; a rejected position is simply written again by the next round. Depth k's cache and
hidden states stay valid only up to the last position whose token k ahead is a verified one;
later positions are recomputed each round. One sequence at a time, on one process.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.inference.kv_cache import KVCache


@dataclasses.dataclass
class SpeculativeResult:
    output_ids: list[int]
    finish_reason: str  # "stop" (end token) or "length"
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    rounds: int  # main-model verification forwards (after the prompt's)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def distributions(
    logits: torch.Tensor, vocab_size: int, temperature: float, top_k: int
) -> torch.Tensor:
    """Probabilities [n, V] of logits [n, V_padded] (padded entries never drawn): one-hot on the
    argmax at temperature 0, else softmax(logits / temperature) among the top_k (0: all)."""
    scores = logits[:, :vocab_size].float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(scores.argmax(-1), vocab_size).float()
    scores = scores / temperature
    if top_k > 0:
        kth = scores.topk(min(top_k, vocab_size), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.softmax(scores, dim=-1)


def verify(
    target: torch.Tensor, draft: torch.Tensor, drafts: list[int], generator: torch.Generator
) -> tuple[int, int]:
    """The rejection rule: (drafts accepted, the token after them). `target` [K + 1, V]: the main
    model's distribution at the pending token and after each draft; `draft` [K, V]: the
    distributions the drafts were drawn from."""
    for j, token in enumerate(drafts):
        p, q = target[j, token].item(), draft[j, token].item()
        if torch.rand((), generator=generator).item() * q < p:  # u < p / q, without dividing
            continue
        residual = (target[j] - draft[j]).clamp(min=0)
        residual = residual if residual.sum() > 0 else target[j]
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    last = target[len(drafts)]
    return len(drafts), int(torch.multinomial(last, 1, generator=generator))


class MTPSpeculator:
    """Speculative generation for one GPT chunk holding its MTP layers (see the module docstring)."""

    def __init__(self, model: nn.Module, num_speculative_tokens: int, vocab_size: int) -> None:
        depths = len(model.mtp.layers) if getattr(model, "mtp", None) is not None else 0
        if not 0 < num_speculative_tokens <= depths:
            raise GigatronError(
                f"--num-speculative-tokens {num_speculative_tokens}: the model has {depths} "
                "multi-token prediction layer(s) (--mtp-num-layers); give 1 .. that many"
            )
        self.model = model
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size

    def _embed_run(self, tokens: list[int], start: int, shift: int):
        device = next(self.model.parameters()).device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None, :]
        rotary = self.model.rotary(positions) if self.model.rotary is not None else None
        return self.model.embedding(ids, positions + shift), rotary, positions

    def _main(self, cache: KVCache, tokens: list[int], start: int):
        """Hidden states [n, 1, h] and logits [n, V] of the main model on `tokens` at `start`."""
        cache.begin_step([0], [start], [len(tokens)], len(tokens), all_logits=True)
        hidden, rotary, _ = self._embed_run(tokens, start, 0)
        hidden = self.model.decoder(hidden, None, rotary, inference_cache=cache)
        return hidden, self.model.output_layer(hidden, self.model.output_weight())[:, 0]

    def _depth(self, cache: KVCache, depth: int, previous: torch.Tensor, tokens, start: int):
        """Depth `depth`'s hidden states and logits at positions start.. (see models/mtp.py)."""
        layer = self.model.mtp.layers[depth - 1]
        cache.begin_step([0], [start], [len(tokens)], len(tokens), all_logits=True)
        embedded, rotary, _ = self._embed_run(tokens, start, depth)
        x = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(previous)], dim=-1))
        x = layer.mtp_model_layer(x, None, rotary, inference_cache=cache)
        hidden = layer.final_layernorm(x)
        return hidden, self.model.output_layer(hidden, self.model.output_weight())[:, 0]

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        eos_id: int | None = None,
    ) -> SpeculativeResult:
        """`max_tokens` tokens after `prompt` (fewer at `eos_id`, which is not included)."""
        if not prompt:
            raise GigatronError("speculative decoding: an empty prompt; give at least one token")
        table = self.model.embedding.position_embeddings  # None with rotary positions
        needed = len(prompt) + max_tokens + self.k  # the heads embed up to K positions ahead
        if table is not None and needed > table.num_embeddings:
            raise GigatronError(
                f"speculative decoding: prompt + --max-tokens + --num-speculative-tokens = "
                f"{needed} positions, past the model's {table.num_embeddings}; shorten the "
                "prompt or lower --max-tokens"
            )
        generator = torch.Generator().manual_seed(seed)
        cache = KVCache([self.model], 1, len(prompt) + max_tokens + self.k + 1)
        probs = functools.partial(
            distributions, vocab_size=self.vocab_size, temperature=temperature, top_k=top_k
        )
        hidden, logits = self._main(cache, prompt, 0)
        first = int(torch.multinomial(probs(logits[-1:])[0], 1, generator=generator))
        state = _State(list(prompt) + [first], len(prompt), [hidden], self.k)
        result = SpeculativeResult([], "length", 0, 0, 0)
        while not _finished(state, result, len(prompt), max_tokens, eos_id):
            drafts, draft_probs = self._draft(cache, state, probs, generator)
            pending = state.tokens[state.fed :]
            hidden, logits = self._main(cache, pending + drafts, state.fed)
            accepted, after = verify(probs(logits), draft_probs, drafts, generator)
            state.hist[0] = torch.cat([state.hist[0][: state.fed], hidden[: 1 + accepted]])
            state.fed += 1 + accepted
            state.tokens += drafts[:accepted] + [after]
            result.drafted += len(drafts)
            result.accepted += accepted
            result.rounds += 1
        return result

    def _draft(self, cache: KVCache, state: _State, probs, generator):
        """K draft tokens and their distributions [K, V]; depth k's cache and hidden states
        are brought up to the last verified position first."""
        drafts: list[int] = []
        rows = []
        end = len(state.tokens) - 1  # positions < end have verified main hidden states
        for depth in range(1, self.k + 1):
            start = state.valid[depth]
            extended = state.tokens + drafts
            previous = state.hist[depth - 1][start:end]
            hidden, logits = self._depth(
                cache, depth, previous, extended[start + depth : end + depth], start
            )
            state.hist[depth] = torch.cat([state.hist[depth][:start], hidden])
            state.valid[depth] = max(0, len(state.tokens) - depth)
            rows.append(probs(logits[-1:])[0])
            drafts.append(int(torch.multinomial(rows[-1], 1, generator=generator)))
        return drafts, torch.stack(rows)


class _State:
    """One sequence's tokens (verified), main-model positions fed, per depth the hidden states
    (depth 0: the main model's) and the first position to recompute."""

    def __init__(self, tokens: list[int], fed: int, hist: list[torch.Tensor], k: int) -> None:
        self.tokens, self.fed = tokens, fed
        empty = hist[0][:0]
        self.hist = hist + [empty] * k
        self.valid = [fed] + [0] * k


def _finished(state: _State, result: SpeculativeResult, prompt: int, limit: int, eos) -> bool:
    return settle_output(result, state.tokens[prompt:], limit, eos)


def settle_output(result: SpeculativeResult, output: list[int], limit: int, eos) -> bool:
    """Cut `output` (the tokens after the prompt) at the end token or `limit` into `result`;
    True when the sequence is done."""
    if eos is not None and eos in output[:limit]:
        result.output_ids, result.finish_reason = output[: output.index(eos)], "stop"
        return True
    result.output_ids = output[:limit]
    return len(output) >= limit
