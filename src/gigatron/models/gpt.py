"""GPT: embedding -> transformer block -> output layer and loss, split into pipeline chunks.

One `GPTModel` is one model chunk: the first chunk holds the embedding (`pre_process`), the last
the final norm, output layer and loss (`post_process`), and each holds a range of layers named by
their global index. `build_model(cfg, pctx)` returns this rank's chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.models.transformer import RotaryEmbedding, TransformerBlock, TransformerSpec
from gigatron.parallel.collectives import scatter_to_sequence_parallel_region
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline import chunk_layer_ranges
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    initialize_parameters,
    padded_vocab_size,
    set_tensor_parallel_attributes,
    vocab_parallel_cross_entropy,
)


class LanguageModelEmbedding(nn.Module):
    """Word (+ learned position) embeddings -> [seq(/tp with SP), batch, hidden], then dropout."""

    def __init__(
        self, spec: TransformerSpec, pctx: ParallelContext, vocab_size: int, rng: ModelParallelRNG
    ) -> None:
        super().__init__()
        self.pctx = pctx
        self.sequence_parallel = spec.sequence_parallel
        self.dropout = spec.hidden_dropout
        self.rng = rng
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            spec.hidden_size,
            pctx,
            sequence_parallel=spec.sequence_parallel,
            init_std=spec.init_method_std,
            dtype=spec.params_dtype,
        )
        if spec.position_embedding_type == "learned_absolute":
            if not spec.max_position_embeddings:
                raise GigatronError(
                    "--max-position-embeddings (or --seq-length) is needed for learned absolute "
                    "position embeddings"
                )
            self.position_embeddings = nn.Embedding(
                spec.max_position_embeddings,
                spec.hidden_size,
                dtype=spec.params_dtype,
                device=pctx.device,
            )
            set_tensor_parallel_attributes(
                self.position_embeddings.weight, False, init="normal", init_std=spec.init_method_std
            )
        else:
            self.position_embeddings = None

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        # Look up in [seq, batch] order so the result is already in the block's layout.
        x = self.word_embeddings(tokens.t())
        if self.position_embeddings is not None:
            if position_ids is None:
                raise GigatronError("learned absolute position embeddings need position_ids")
            positions = self.position_embeddings(position_ids.t())
            if self.sequence_parallel:
                # Replicated table: each rank adds the rows of its own slice of the sequence.
                positions = scatter_to_sequence_parallel_region(positions, self.pctx)
            x = x + positions
        if self.sequence_parallel:
            with self.rng.fork():
                return F.dropout(x, self.dropout, self.training)
        return F.dropout(x, self.dropout, self.training)


class GPTModel(nn.Module):
    """One pipeline chunk of a GPT (see the module docstring and docs/architecture.md)."""

    def __init__(
        self,
        spec: TransformerSpec,
        pctx: ParallelContext,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: range | None = None,
        rng: ModelParallelRNG | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.pctx = pctx
        self.vocab_size = vocab_size
        self.pre_process = pre_process
        self.post_process = post_process
        self.rng = rng or ModelParallelRNG.for_rank(spec.seed, pctx)
        self.input_tensor: torch.Tensor | None = None
        self.share_embeddings = not spec.untie_embeddings_and_output_weights
        layer_numbers = range(spec.num_layers) if layer_numbers is None else layer_numbers
        self.layer_numbers = layer_numbers

        if pre_process:
            self.embedding = LanguageModelEmbedding(spec, pctx, vocab_size, self.rng)
        self.rotary = (
            RotaryEmbedding(spec.kv_channels, spec.rotary_percent, spec.rotary_base)
            if spec.position_embedding_type == "rope"
            else None
        )
        self.decoder = TransformerBlock(spec, pctx, layer_numbers, post_process, self.rng)
        if post_process:
            self.output_layer = ColumnParallelLinear(
                spec.hidden_size,
                vocab_size,
                pctx,
                bias=False,
                sequence_parallel=spec.sequence_parallel,
                init_std=spec.init_method_std,
                skip_weight=self.share_embeddings and pre_process,
                dtype=spec.params_dtype,
            )
            if self.share_embeddings and not pre_process:
                # The last stage's copy of the tied weight: drawn from the same generator as the
                # word embedding, so both copies start equal without any communication.
                self.output_layer.weight.init_name = "embedding.word_embeddings.weight"
                self.output_layer.weight.shared_embedding = True
        if pre_process and self.share_embeddings and pctx.pp_size > 1:
            self.embedding.word_embeddings.weight.shared_embedding = True

    def set_input_tensor(self, input_tensor: torch.Tensor | list | tuple | None) -> None:
        """The hidden states from the previous pipeline stage (used instead of `tokens`)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def output_weight(self) -> torch.Tensor:
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.pre_process:
            hidden = self.embedding(tokens, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first pipeline chunk needs set_input_tensor() first")
            hidden = self.input_tensor

        rotary = None
        if self.rotary is not None:
            seq = hidden.shape[0] * (self.pctx.tp_size if self.spec.sequence_parallel else 1)
            if position_ids is None:
                position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
            rotary = self.rotary(position_ids)

        hidden = self.decoder(hidden, attention_mask, rotary)
        if not self.post_process:
            return hidden

        logits = self.output_layer(hidden, self.output_weight())  # [s, b, vocab/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.pctx)
        return loss.t().contiguous()


def resolve_vocab_size(cfg, tp_size: int, vocab_size: int | None = None) -> int:
    """The padded vocabulary: --padded-vocab-size if given, else the tokenizer's size (argument
    or --vocab-size) padded to a multiple of --make-vocab-size-divisible-by x tp."""
    m = cfg.model
    if m.padded_vocab_size is not None:
        if m.padded_vocab_size % tp_size:
            raise GigatronError(
                f"--padded-vocab-size {m.padded_vocab_size} is not divisible by the "
                f"tensor-parallel size {tp_size}; pick a multiple of it"
            )
        return m.padded_vocab_size
    size = vocab_size if vocab_size is not None else cfg.tokenizer.vocab_size
    if size is None:
        raise GigatronError(
            "the vocabulary size is unknown: pass the tokenizer's vocab_size to build_model, "
            "or give --vocab-size or --padded-vocab-size"
        )
    return padded_vocab_size(size, m.make_vocab_size_divisible_by, tp_size)


def build_model(cfg, pctx: ParallelContext, vocab_size: int | None = None) -> list[GPTModel]:
    """This rank's GPT chunks (one per virtual pipeline stage), initialised from
    cfg.training.seed identically to the tp = 1, pp = 1 model.

    `vocab_size` is the tokenizer's vocabulary (unpadded); see `resolve_vocab_size`.
    """
    spec = TransformerSpec.from_config(cfg)
    p = cfg.parallel
    vp = p.num_virtual_stages_per_pipeline_rank or 1
    if vp > 1 and pctx.pp_size == 1:
        raise GigatronError(
            "virtual pipeline stages need --pipeline-model-parallel-size > 1; drop "
            "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage"
        )
    padded = resolve_vocab_size(cfg, pctx.tp_size, vocab_size)
    ranges = chunk_layer_ranges(
        spec.num_layers,
        pctx.pp_size,
        vp,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
    )[pctx.pp_rank]
    rng = ModelParallelRNG.for_rank(spec.seed, pctx)
    chunks = []
    for index, layers in enumerate(ranges):
        chunk = GPTModel(
            spec,
            pctx,
            padded,
            pre_process=pctx.is_pipeline_first_stage() and index == 0,
            post_process=pctx.is_pipeline_last_stage() and index == len(ranges) - 1,
            layer_numbers=layers,
            rng=rng,
        )
        initialize_parameters(chunk, spec.seed, pctx.tp_rank, pctx.tp_size)
        chunks.append(chunk)
    return chunks
