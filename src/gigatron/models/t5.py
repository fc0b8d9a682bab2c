"""T5: an encoder and a decoder with cross-attention, one shared word embedding, and the output
layer tied to it (Megatron-Core's T5Model); split into pipeline chunks.

Two variants, chosen by flags:
- Megatron's T5: learned absolute positions (one table for both streams), LayerNorm with bias,
  GeLU MLP, an output layer tied to the embedding with its own bias.
- The Hugging Face T5 v1.1 layout: `--position-embedding-type relative` (bucketed relative
  position biases, one table per stack shared by its layers, added to the attention scores),
  `--normalization RMSNorm --disable-bias-linear --geglu --openai-gelu` (gated-gelu), so that
  `T5ForConditionalGeneration` weights can be used (families/t5/hf_t5.py).

Layers are pre-norm. Encoder layers are `TransformerLayer`s; a decoder layer adds, between its
self-attention and its MLP, a cross-attention over the encoder output
(`pre_cross_attn_layernorm`, `cross_attention.linear_q`, `cross_attention.linear_kv` with rows
[k; v] per key/value group, `cross_attention.linear_proj`).

Masks are built here from the padding masks (1 = real token): encoder self-attention masks the
padded keys; decoder self-attention is causal and masks padded keys; cross-attention masks the
padded encoder keys. With relative positions the masks become float biases.

A chunk on a pipeline stage holds encoder layers or decoder layers (families/t5/ places them);
with both, it runs the whole model.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from gigatron.models import mup
from gigatron.models.embedding import LanguageModelEmbedding, resolve_vocab_size
from gigatron.models.language_model import LanguageModelStage
from gigatron.models.meta_init import materialize, parameters_on_meta
from gigatron.models.transformer import (
    Attention,
    CoreAttention,
    LayerParts,
    TransformerBlock,
    TransformerLayer,
    column_linear,
    row_linear,
)
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import (
    divide,
    initialize_parameters,
    set_tensor_parallel_attributes,
)


def relative_position_buckets(
    query_length: int,
    key_length: int,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """T5's bucket of every (query, key) pair, [query_length, key_length] int64: exact buckets
    for short distances, logarithmic ones up to `max_distance`; keys after the query get their
    own half of the buckets when `bidirectional`, else share bucket 0."""
    distance = (
        torch.arange(key_length, device=device)[None, :]
        - torch.arange(query_length, device=device)[:, None]
    )
    buckets = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (distance > 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = (-distance).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """One stack's relative position bias: `relative_attention_bias.weight` [buckets, heads],
    split over tensor-parallel ranks by heads (dim 1)."""

    def __init__(
        self, config: TransformerConfig, pctx: ParallelContext, bidirectional: bool
    ) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        heads = divide(config.num_attention_heads, pctx.tp_size, "--num-attention-heads")
        self.relative_attention_bias = nn.Embedding(
            self.num_buckets, heads, dtype=config.params_dtype, device=pctx.device
        )
        set_tensor_parallel_attributes(
            self.relative_attention_bias.weight,
            True,
            partition_dim=1,
            init="normal",
            init_std=config.init_method_std,
        )

    def forward(self, query_length: int, key_length: int) -> torch.Tensor:
        """[1, heads/tp, query_length, key_length]."""
        weight = self.relative_attention_bias.weight
        buckets = relative_position_buckets(
            query_length,
            key_length,
            self.bidirectional,
            self.num_buckets,
            self.max_distance,
            weight.device,
        )
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)


class CrossAttention(Attention):
    """Queries from the decoder, keys and values from the encoder output."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
        core_attention=None,
    ) -> None:
        super().__init__(config, layer_number, rng)
        self.split_heads(config, pctx)
        hidden, kv_channels = config.hidden_size, config.kv_channels
        q_size = config.num_attention_heads * kv_channels
        self.linear_q = column_linear(config, pctx, hidden, q_size)
        self.linear_kv = column_linear(
            config, pctx, hidden, 2 * config.num_query_groups * kv_channels
        )
        factory = core_attention or CoreAttention
        not_causal = dataclasses.replace(config, causal_attention=False)
        self.core_attention = factory(not_causal, pctx, layer_number, rng)
        self.linear_proj = row_linear(config, pctx, q_size, hidden)

    def keys_values(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [s_enc, b, groups, hn] of the encoder output (generation caches them)."""
        kv = self.linear_kv(memory)
        kv = kv.view(kv.shape[0], kv.shape[1], self.groups, 2, self.kv_channels)
        k, v = (t.squeeze(3) for t in torch.split(kv, [1, 1], dim=3))
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        attention_mask: torch.Tensor | None,
        keys_values: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`keys_values`: `keys_values(memory)` computed before (generation), else computed here."""
        q = self.linear_q(x)
        q = q.view(q.shape[0], q.shape[1], self.heads, self.kv_channels)
        k, v = keys_values if keys_values is not None else self.keys_values(memory)
        return self.attend(q, k, v, attention_mask)


class T5DecoderLayer(TransformerLayer):
    """Pre-norm: self-attention, cross-attention, MLP, each x + drop(part(norm(x)))."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
        parts: LayerParts,
    ) -> None:
        super().__init__(config, pctx, layer_number, rng, parts)
        self.pre_cross_attn_layernorm = parts.norm(config, pctx)
        self.cross_attention = CrossAttention(config, pctx, layer_number, rng, parts.core_attention)

    def forward(self, x, self_mask, memory, cross_mask, inference_cache=None):  # type: ignore[override]
        """`inference_cache` (generation, `inference.t5_generation.T5DecoderCache`): the
        self-attention keys and values so far and the cross-attention ones of `memory`."""
        if inference_cache is None:
            attn = self.self_attention(self.input_layernorm(x), self_mask)
            cross_kv = None
        else:
            attn = self.self_attention(
                self.input_layernorm(x), self_mask, inference_cache=inference_cache
            )
            cross_kv = inference_cache.cross_keys_values(self.layer_number, self.cross_attention)
        x = self.residual_add(x, attn)
        normed = self.pre_cross_attn_layernorm(x)
        x = self.residual_add(x, self.cross_attention(normed, memory, cross_mask, cross_kv))
        return self.residual_add(x, self.mlp(self.pre_mlp_layernorm(x)))


class T5DecoderBlock(TransformerBlock):
    """The decoder layers of one chunk and, where the decoder ends, its final norm: a
    `TransformerBlock` of `T5DecoderLayer`s (`layer_builder=partial(T5DecoderLayer,
    parts=parts)`), whose layers also take the encoder output and the cross-attention mask."""

    def forward(self, x, self_mask, memory, cross_mask) -> torch.Tensor:  # type: ignore[override]
        x = self.run_layers(x, self_mask, memory, cross_mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x


class T5Model(LanguageModelStage):
    """One pipeline chunk of a T5 (see the module docstring and docs/architecture.md).

    `encoder_layers` / `decoder_layers`: the global layer numbers of each stack on this chunk
    (None: the chunk has none of that stack). `pre_process`: the chunk embeds the tokens of the
    stack it starts (the encoder's first stage, the decoder's first stage). `encoder_final`: the
    chunk ends the encoder (holds its final norm). `post_process`: the chunk ends the decoder
    (final norm and output layer). What the previous stage sends (`set_input_tensor`, a list):
    [encoder hidden] on an encoder stage, [encoder output] on the decoder's first stage,
    [decoder hidden, encoder output] after.
    """

    def __init__(
        self,
        encoder_config: TransformerConfig,
        decoder_config: TransformerConfig,
        pctx: ParallelContext,
        vocab_size: int,
        pre_process: bool,
        post_process: bool,
        encoder_layers: range | None,
        decoder_layers: range | None,
        encoder_final: bool,
        rng: ModelParallelRNG,
        parts: LayerParts | None = None,
    ) -> None:
        # layer_numbers: set below, per stack
        super().__init__(decoder_config, pctx, vocab_size, pre_process, post_process, None, rng)
        parts = parts or LayerParts()
        self.encoder_config = encoder_config
        self.relative = decoder_config.position_embedding_type == "relative"
        self.layer_numbers = {"encoder": encoder_layers, "decoder": decoder_layers}
        self.add_encoder = encoder_layers is not None
        self.add_decoder = decoder_layers is not None

        if pre_process:
            self.embedding = LanguageModelEmbedding(decoder_config, pctx, vocab_size, rng)
        if self.add_encoder:
            if self.relative:
                self.encoder_relative_pos_emb = RelativePositionBias(
                    encoder_config, pctx, bidirectional=True
                )
            self.encoder = TransformerBlock(
                encoder_config, pctx, encoder_layers, encoder_final, rng, parts
            )
        if self.add_decoder:
            if self.relative:
                self.decoder_relative_pos_emb = RelativePositionBias(
                    decoder_config, pctx, bidirectional=False
                )
            self.decoder = T5DecoderBlock(
                decoder_config, pctx, decoder_layers, post_process, rng, parts,
                layer_builder=functools.partial(T5DecoderLayer, parts=parts),
            )  # fmt: skip
        self.tied = not decoder_config.untie_embeddings_and_output_weights
        if post_process:
            # Megatron's T5 head: tied to the embedding with a bias of its own, or untied
            # without one.
            self.add_output_layer(self.tied, self.tied, pre_process)
        if pre_process and pctx.pp_size > 1:
            # The encoder's and the decoder's first stages hold the same embedding (and the
            # last stage the tied output weight): finalize_model_grads sums their gradients.
            self.embedding.word_embeddings.weight.shared_embedding = True
            if self.embedding.position_embeddings is not None:
                self.embedding.position_embeddings.weight.shared_position_embedding = True

    def _bias_or_mask(self, mask: torch.Tensor, table: str, sq: int, sk: int) -> torch.Tensor:
        """The bool mask, or with relative positions the float bias with masked keys at the
        dtype's minimum."""
        if not self.relative:
            return mask
        bias = getattr(self, table)(sq, sk)
        return bias.masked_fill(mask, torch.finfo(bias.dtype).min)

    def forward(
        self,
        encoder_input_ids: torch.Tensor | None,
        decoder_input_ids: torch.Tensor | None,
        encoder_padding_mask: torch.Tensor,
        decoder_padding_mask: torch.Tensor,
    ):
        """Ids and padding masks (1 = real token) are [b, s_enc] and [b, s_dec].

        Returns: on the decoder's last stage, logits [b, s_dec, vocab/tp] (a transposed view);
        on an encoder stage, encoder hidden states [s_enc(/tp with SP), b, h]; on a decoder
        stage before the last, [decoder hidden, encoder output]."""
        enc_keys = (encoder_padding_mask == 0)[:, None, None, :]
        if self.add_encoder:
            if self.pre_process:
                hidden = self.embedding(encoder_input_ids, _positions(encoder_input_ids))
            else:
                hidden = self.stage_input(0)
            s_enc = enc_keys.shape[-1]
            mask = self._bias_or_mask(enc_keys, "encoder_relative_pos_emb", s_enc, s_enc)
            encoder_output = self.encoder(hidden, mask)
            if not self.add_decoder:
                return encoder_output
            decoder_hidden = None
        elif self.pre_process:
            encoder_output, decoder_hidden = self.stage_input(0), None
        else:
            decoder_hidden, encoder_output = self.stage_input(0), self.stage_input(1)

        if decoder_hidden is None:
            decoder_hidden = self.embedding(decoder_input_ids, _positions(decoder_input_ids))
        s_dec = decoder_padding_mask.shape[-1]
        causal = torch.ones(s_dec, s_dec, dtype=torch.bool, device=enc_keys.device).triu(1)
        self_mask = causal | (decoder_padding_mask == 0)[:, None, None, :]
        self_mask = self._bias_or_mask(self_mask, "decoder_relative_pos_emb", s_dec, s_dec)
        decoder_hidden = self.decoder(decoder_hidden, self_mask, encoder_output, enc_keys)
        if not self.post_process:
            return [decoder_hidden, encoder_output]
        logits = self.output_layer(decoder_hidden, self.output_weight())
        return logits.transpose(0, 1)

    def encode(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """Generation (a chunk holding the whole model): the encoder output [s_enc, b, h] of
        ids [b, s_enc] with their padding mask (1 = real token)."""
        keys = (padding_mask == 0)[:, None, None, :]
        hidden = self.embedding(input_ids, _positions(input_ids))
        s_enc = keys.shape[-1]
        return self.encoder(
            hidden, self._bias_or_mask(keys, "encoder_relative_pos_emb", s_enc, s_enc)
        )

    def decode(
        self,
        token_ids: torch.Tensor,
        start: int,
        memory: torch.Tensor,
        encoder_padding_mask: torch.Tensor,
        inference_cache,
    ) -> torch.Tensor:
        """Generation: the decoder on tokens [b, s] at positions start .. start + s - 1 of every
        row, attending to the cached ones before; logits [b, s, vocab/tp]."""
        batch, seq = token_ids.shape
        end = start + seq
        positions = torch.arange(start, end, device=token_ids.device).expand(batch, seq)
        hidden = self.embedding(token_ids, positions)
        causal = torch.ones(end, end, dtype=torch.bool, device=token_ids.device).triu(1)
        self_mask = causal[start:end][None, None]
        if self.relative:
            bias = self.decoder_relative_pos_emb(end, end)[:, :, start:end]
            self_mask = bias.masked_fill(self_mask, torch.finfo(bias.dtype).min)
        inference_cache.self_mask = self_mask
        cross_mask = (encoder_padding_mask == 0)[:, None, None, :]
        for layer in self.decoder.layers.values():
            hidden = layer(hidden, self_mask, memory, cross_mask, inference_cache=inference_cache)
        hidden = self.decoder.final_layernorm(hidden)
        return self.output_layer(hidden, self.output_weight()).transpose(0, 1)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    batch, seq = ids.shape
    return torch.arange(seq, device=ids.device).expand(batch, seq)


def t5_stage_layout(
    pp_size: int, split_rank: int | None, encoder_layers: int, decoder_layers: int
) -> list[tuple[range | None, range | None, bool]]:
    """Per pipeline stage: (encoder layers, decoder layers, ends the encoder). Stages below the
    split rank (default pp / 2) hold the encoder, the others the decoder, each stack split
    evenly (earlier stages take the remainder); with one stage, both stacks."""
    if pp_size == 1:
        return [(range(encoder_layers), range(decoder_layers), True)]
    split = pp_size // 2 if split_rank is None else split_rank
    layout: list[tuple[range | None, range | None, bool]] = []
    for stage, ranges in enumerate(_even_split(encoder_layers, split)):
        layout.append((ranges, None, stage == split - 1))
    for ranges in _even_split(decoder_layers, pp_size - split):
        layout.append((None, ranges, False))
    return layout


def _even_split(num_layers: int, parts: int) -> list[range]:
    base, extra = divmod(num_layers, parts)
    ranges, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def t5_configs(cfg) -> tuple[TransformerConfig, TransformerConfig]:
    """The encoder's and the decoder's TransformerConfig (layer counts, causality)."""
    mup.check_mup(cfg, "T5")
    m = cfg.model
    encoder_layers = m.encoder_num_layers or m.num_layers
    decoder_layers = m.decoder_num_layers or m.num_layers
    encoder = TransformerConfig.from_config(cfg, num_layers=encoder_layers, causal_attention=False)
    decoder = TransformerConfig.from_config(cfg, num_layers=decoder_layers)
    return encoder, decoder


def build_t5_model(
    cfg, pctx: ParallelContext, vocab_size: int | None = None, parts: LayerParts | None = None
) -> list[T5Model]:
    """This rank's T5 chunk (one per pipeline stage), initialised identically to the
    one-process model."""

    encoder_config, decoder_config = t5_configs(cfg)
    padded = resolve_vocab_size(cfg, pctx.tp_size, vocab_size)
    layout = t5_stage_layout(
        pctx.pp_size,
        cfg.parallel.pipeline_model_parallel_split_rank,
        encoder_config.num_layers,
        decoder_config.num_layers,
    )
    encoder_layers, decoder_layers, encoder_final = layout[pctx.pp_rank]
    previous = layout[pctx.pp_rank - 1] if pctx.pp_rank > 0 else None
    # The encoder's first stage and the decoder's first stage embed.
    pre_process = previous is None or (decoder_layers is not None and previous[1] is None)
    rng = ModelParallelRNG.for_rank(cfg.training.seed, pctx)
    with parameters_on_meta(cfg.model.init_model_with_meta_device):
        chunk = T5Model(
            encoder_config,
            decoder_config,
            pctx,
            padded,
            pre_process,
            pctx.is_pipeline_last_stage(),
            encoder_layers,
            decoder_layers,
            encoder_final,
            rng,
            parts,
        )
    if cfg.model.init_model_with_meta_device:
        materialize(chunk, pctx.device)
    initialize_parameters(chunk, cfg.training.seed, pctx.tp_rank, pctx.tp_size)
    return [chunk]
