"""Retro (Borgeaud et al. 2022, Megatron-Core 0.12.3's RetroModel): a GPT whose decoder layers
6, 9, 12, ... (9, 12, ... above 15 layers: Megatron's placement) add a chunked cross-attention
to neighbour chunks retrieved from a database, encoded by a small bidirectional encoder.

Shapes (Megatron's notation): s tokens per sample in l = s / m chunks of m tokens; k neighbours
per chunk, each r = m * num_retrieved_chunks tokens (neighbour + continuation).

- The encoder lives in the first Retro layer (`cross_attention.encoder`): it embeds the
  neighbour tokens [b, l, k, r] with the decoder's embedding, runs a self-attention and, in its
  first layer only, a cross-attention from each neighbour of chunk j to chunk j's (normed)
  decoder states, then hands its output [r * k, b * l, d] to every later Retro layer.
- Causal by construction: the decoder attends from the tokens shifted by m - 1 (chunk j's
  group is positions j*m + m-1 .. j*m + 2m-2), so position p sees only neighbours of chunk
  (p - m + 1) // m, retrieved with tokens up to p; positions before m - 1 see none.
- Pipeline parallelism: the first stage embeds the tokens and the neighbours; every stage
  passes [hidden states, neighbours] to the next (the neighbours embedded before the encoder's
  layer, encoded after it), so a Retro layer on any stage reads the encoder's output.
- `--retro-attention-gate` scales the chunked cross-attention's output (Megatron's legacy model;
  Megatron-Core's is the gate 1): 0 turns the model into the GPT of its other weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.models import mup
from gigatron.models.build import build_model_chunks, layer_parts_for_run
from gigatron.models.gpt import GPTModel
from gigatron.models.t5 import CrossAttention
from gigatron.models.transformer import LayerParts, TransformerLayer
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.collectives import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG


@dataclass(frozen=True)
class RetroSpec:
    """The Retro-only shape of the model: config/retro.py's flags (their defaults there)."""

    chunk_length: int
    num_neighbors: int
    num_retrieved_chunks: int
    encoder_layers: int
    encoder_hidden_dropout: float
    encoder_attention_dropout: float
    attention_gate: float
    # Megatron-Core 0.12.3's Retro block spec has no final norm (its TransformerBlockSubmodules
    # name none); gigatron keeps the GPT's, so a retro-fitted GPT keeps its output. False builds
    # Megatron-Core's layout (tests compare logits with it).
    final_norm: bool = True

    @property
    def retrieved_length(self) -> int:
        """r: tokens of one neighbour (the neighbour chunk and its continuation)."""
        return self.chunk_length * self.num_retrieved_chunks

    @classmethod
    def from_config(cls, cfg) -> RetroSpec:
        r = cfg.retro
        encoder = (
            r.retro_encoder_layers,
            r.retro_encoder_hidden_dropout,
            r.retro_encoder_attention_dropout,
        )
        chunks = (r.retro_gpt_chunk_length, r.retro_num_neighbors, r.retro_num_retrieved_chunks)
        return cls(*chunks, *encoder, r.retro_attention_gate)


def retro_layer_numbers(num_layers: int) -> list[int]:
    """The 1-based decoder layers with chunked cross-attention (Megatron's rule)."""
    start = 6 if num_layers <= 15 else 9
    numbers = list(range(start, num_layers + 1, 3))
    if not numbers:
        raise GigatronError(
            f"--num-layers {num_layers}: a Retro decoder needs at least 6 layers (its chunked "
            "cross-attention layers are 6, 9, 12, ... as Megatron places them); raise --num-layers"
        )
    return numbers


def to_chunks(x: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """[l*m, b, d] -> [m, b*l, d] (batch index b_i * l + chunk)."""
    seq, batch, width = x.shape
    chunks = seq // chunk_length
    x = x.reshape(chunks, chunk_length, batch, width).permute(1, 2, 0, 3)
    return x.reshape(chunk_length, batch * chunks, width)


def from_chunks(x: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of `to_chunks`: [m, b*l, d] -> [l*m, b, d]."""
    chunk_length, rows, width = x.shape
    chunks = rows // batch
    x = x.reshape(chunk_length, batch, chunks, width).permute(2, 0, 1, 3)
    return x.reshape(chunks * chunk_length, batch, width)


def _replicated(config: TransformerConfig, **changes) -> TransformerConfig:
    """`config` for parts every tp rank runs on whole tensors (chunk layouts are not sequence
    slices): no sequence parallelism, bidirectional attention."""
    return dataclasses.replace(config, sequence_parallel=False, causal_attention=False, **changes)


class NeighbourCrossAttention(nn.Module):
    """The encoder's cross-attention: each neighbour of chunk j (queries) attends to chunk j's
    decoder states (keys, values)."""

    def __init__(self, config, pctx: ParallelContext, rng: ModelParallelRNG, neighbours: int):
        super().__init__()
        self.attn = CrossAttention(config, pctx, 1, rng)
        self.neighbours = neighbours

    def forward(self, x: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        # x [r, b*l*k, d] (k fastest), chunks [m, b*l, d]: each neighbour row meets its chunk.
        memory = chunks.repeat_interleave(self.neighbours, dim=1)
        return self.attn(x, memory, None)


class RetroEncoderLayer(TransformerLayer):
    """The encoder's first layer: self-attention over each neighbour, then cross-attention to its
    chunk (whose residual is the normed input, as in Megatron-Core), then the MLP."""

    def __init__(self, config, cross_config, pctx, rng, parts: LayerParts, neighbours: int):
        super().__init__(config, pctx, 1, rng, parts)
        self.pre_cross_attn_layernorm = parts.norm(config, pctx)
        self.cross_attention = NeighbourCrossAttention(cross_config, pctx, rng, neighbours)

    def forward(self, x: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.residual_add(x, self.self_attention(self.input_layernorm(x)))
        normed = self.pre_cross_attn_layernorm(x)
        x = self.residual_add(normed, self.cross_attention(normed, chunks))
        return self.residual_add(x, self.mlp(self.pre_mlp_layernorm(x)))


class RetroEncoder(nn.Module):
    """Embedded neighbours [r, b*l*k, d] and the decoder's chunks [m, b*l, d] -> the encoded
    neighbours [r*k, b*l, d] (no final norm, as in Megatron-Core)."""

    def __init__(self, config, pctx, rng, parts: LayerParts, spec: RetroSpec) -> None:
        super().__init__()
        self.neighbours = spec.num_neighbors
        encoder_config = _replicated(
            config,
            hidden_dropout=spec.encoder_hidden_dropout,
            attention_dropout=spec.encoder_attention_dropout,
        )
        cross_config = _replicated(config)
        layers: list[nn.Module] = [
            RetroEncoderLayer(encoder_config, cross_config, pctx, rng, parts, self.neighbours)
        ]
        for number in range(2, spec.encoder_layers + 1):
            layers.append(TransformerLayer(encoder_config, pctx, number, rng, parts))
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})

    def forward(self, x: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        first, *rest = self.layers.values()
        x = first(x, chunks)
        for layer in rest:
            x = layer(x)
        retrieved, rows, width = x.shape
        x = x.reshape(retrieved, rows // self.neighbours, self.neighbours, width)
        return x.permute(0, 2, 1, 3).reshape(retrieved * self.neighbours, -1, width)


class ChunkedCrossAttention(nn.Module):
    """The decoder's chunked cross-attention on whole (not sequence-parallel) states [s, b, d];
    the first Retro layer also holds the encoder."""

    def __init__(self, config, pctx, layer_number, rng, parts, spec: RetroSpec, encoder: bool):
        super().__init__()
        self.attn = CrossAttention(_replicated(config), pctx, layer_number, rng)
        self.encoder = RetroEncoder(config, pctx, rng, parts, spec) if encoder else None
        self.chunk_length = spec.chunk_length

    def forward(
        self, normed: torch.Tensor, context: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [s, b, d], zero before position m - 1; the encoded neighbours)."""
        m = self.chunk_length
        seq, batch, _ = normed.shape
        if self.encoder is not None:
            context = self.encoder(context, to_chunks(normed, m))
        shifted = F.pad(normed[m - 1 :], (0, 0, 0, 0, 0, m - 1))
        out = from_chunks(self.attn(to_chunks(shifted, m), context, None), batch)
        return F.pad(out[: seq - m + 1], (0, 0, 0, 0, m - 1, 0)), context


class RetroDecoderLayer(TransformerLayer):
    """A decoder layer with chunked cross-attention between self-attention and MLP."""

    def __init__(self, config, pctx, layer_number, rng, parts, spec: RetroSpec, encoder: bool):
        super().__init__(config, pctx, layer_number, rng, parts)
        self.pctx = pctx
        self.pre_cross_attn_layernorm = parts.norm(config, pctx)
        self.cross_attention = ChunkedCrossAttention(
            config, pctx, layer_number, rng, parts, spec, encoder
        )
        self.gate = spec.attention_gate

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, attention_mask, rotary, context: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.input_layernorm(x)
        attn = self.self_attention(normed, attention_mask, rotary)
        x = self.residual_add(normed if self.residual_from_norm else x, attn)
        normed = self.pre_cross_attn_layernorm(x)
        if self.sequence_parallel:  # the chunks cross the ranks' sequence slices
            whole = gather_from_sequence_parallel_region(normed, self.pctx, reduce_grads=False)
            out, context = self.cross_attention(whole, context)
            out = scatter_to_sequence_parallel_region(out, self.pctx)
        else:
            out, context = self.cross_attention(normed, context)
        x = self.residual_add(normed if self.residual_from_norm else x, self.gate * out)
        normed = self.pre_mlp_layernorm(x)
        return self.residual_add(
            normed if self.residual_from_norm else x, self.mlp(normed)
        ), context


class RetroModel(GPTModel):
    """One pipeline chunk of the Retro decoder. Between stages it passes [hidden states,
    context]: the embedded neighbours [r, b*l*k, d] before the encoder's layer, the encoded ones
    [r*k, b*l, d] after it (`context_shape`), so that every later Retro layer gets them."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        vocab_size: int,
        spec: RetroSpec,
        rng: ModelParallelRNG | None = None,
        parts: LayerParts | None = None,
        stage: tuple[bool, bool, range | None] = (True, True, None),
    ) -> None:
        """`stage`: (pre_process, post_process, this chunk's layers); the default is the
        whole model."""
        parts = parts or LayerParts()
        numbers = retro_layer_numbers(config.num_layers)

        def layer_builder(config, pctx, number, rng):
            if number in numbers:
                encoder = number == numbers[0]
                return RetroDecoderLayer(config, pctx, number, rng, parts, spec, encoder)
            return TransformerLayer(config, pctx, number, rng, parts)

        super().__init__(
            config, pctx, vocab_size, *stage, rng, parts=parts, layer_builder=layer_builder
        )
        self.spec = spec
        if not spec.final_norm:
            self.decoder.final_layernorm = None

    def embed_neighbours(self, neighbour_tokens: torch.Tensor) -> torch.Tensor:
        """[b, l, k, r] token ids -> [r, b*l*k, d] on every tp rank (the decoder's embedding)."""
        ids = neighbour_tokens.reshape(-1, self.spec.retrieved_length)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        x = self.embedding(ids, positions)
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.pctx, reduce_grads=False)
        return mup.scale(x, self.config.mup_embedding_mult)

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        neighbour_tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab/tp] (a transposed view), or with `labels` the per-token losses
        [b, s]; `neighbour_tokens` [b, l, k, r] int64 (read by the first stage). A stage before
        the last returns [hidden states, context] (`context_shape`)."""
        if not self.pre_process:  # what the previous pipeline stage sent
            hidden, context = self.stage_input(0), self.stage_input(1)
        elif neighbour_tokens is None:
            raise GigatronError("a Retro model needs the neighbour tokens of every chunk")
        else:
            self.check_shapes(tokens, neighbour_tokens)
            hidden = mup.scale(self.embedding(tokens, position_ids), self.config.mup_embedding_mult)
            context = self.embed_neighbours(neighbour_tokens)
        rotary = None
        if self.rotary is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            rotary = self.rotary(position_ids)
        for layer in self.decoder.layers.values():
            if isinstance(layer, RetroDecoderLayer):
                hidden, context = layer(hidden, attention_mask, rotary, context)
            else:
                hidden = layer(hidden, attention_mask, rotary)
        if not self.post_process:
            return [hidden, context]  # type: ignore[return-value]
        if self.decoder.final_layernorm is not None:
            hidden = self.decoder.final_layernorm(hidden)
        hidden = mup.scale(hidden, mup.output_mult(self.config))
        if labels is not None:
            return self.token_losses(hidden, labels)
        return self.output_layer(hidden, self.output_weight()).transpose(0, 1)

    def check_shapes(self, tokens: torch.Tensor, neighbour_tokens: torch.Tensor) -> None:
        spec = self.spec
        batch, seq = tokens.shape
        expected = (batch, seq // spec.chunk_length, spec.num_neighbors, spec.retrieved_length)
        if seq % spec.chunk_length or tuple(neighbour_tokens.shape) != expected:
            raise GigatronError(
                f"neighbour tokens {tuple(neighbour_tokens.shape)} for {seq} tokens: expected "
                f"{expected} (seq / --retro-gpt-chunk-length chunks, --retro-num-neighbors, "
                "chunk length x --retro-num-retrieved-chunks)"
            )


def context_shape(
    spec: RetroSpec, seq_length: int, micro_batch: int, hidden: int, encoded: bool
) -> tuple[int, int, int]:
    """The shape of the neighbours a pipeline stage passes on: embedded [r, b*l*k, d], or
    `encoded` (the stage ran the encoder's layer or a later one) [r*k, b*l, d]."""
    rows = micro_batch * (seq_length // spec.chunk_length)
    r, k = spec.retrieved_length, spec.num_neighbors
    return (r * k, rows, hidden) if encoded else (r, rows * k, hidden)


def build_retro_model(
    cfg, pctx: ParallelContext, vocab_size: int | None = None, parts: LayerParts | None = None
) -> list[RetroModel]:
    """This rank's Retro model (one chunk), initialised from cfg.training.seed identically to
    the one-process model."""
    config = TransformerConfig.from_config(cfg)
    spec = RetroSpec.from_config(cfg)
    parts = layer_parts_for_run(cfg, pctx, parts)

    def make_chunk(padded, pre_process, post_process, layers, rng):
        stage = (pre_process, post_process, layers)
        return RetroModel(config, pctx, padded, spec, rng, parts, stage)

    return build_model_chunks(cfg, pctx, vocab_size, make_chunk)
