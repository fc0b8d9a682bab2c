"""Hybrid Mamba-Transformer models (Megatron's `HybridModel`): a GPT whose decoder layers are each
a Mamba layer, an attention layer or an MLP layer, as the stack's pattern says
(`models.hybrid_layout`).

Layers (pre-norm, residual, hidden dropout), named by global index like every gigatron layer:
- `M`: `decoder.layers.{i}.norm.*`, `decoder.layers.{i}.mixer.*` (models/mamba.py);
- `*`: `decoder.layers.{i}.input_layernorm.*`, `decoder.layers.{i}.self_attention.*`;
- `-`: `decoder.layers.{i}.pre_mlp_layernorm.*`, `decoder.layers.{i}.mlp.*`.
The embedding, final norm and output layer are GPT's (`models.gpt.GPTModel`), so pipeline
stages, tied embeddings, sequence parallelism and the loss work unchanged; a pipeline stage holds
whatever kinds its range of layers has.
"""

from __future__ import annotations

from torch import nn

from gigatron.models import mup
from gigatron.models.build import build_model_chunks
from gigatron.models.gpt import GPTModel
from gigatron.models.hybrid_layout import ATTENTION, MAMBA, MLP, resolve_pattern
from gigatron.models.mamba import MambaLayer, MambaSpec
from gigatron.models.transformer import MLP as MLPBlock
from gigatron.models.transformer import Norm, ResidualLayer, SelfAttention
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG


def hybrid_pattern(cfg) -> str:
    """The stack's pattern from the model flags (see `hybrid_layout.resolve_pattern`)."""
    m = cfg.model
    return resolve_pattern(
        m.num_layers,
        m.hybrid_attention_ratio,
        m.hybrid_mlp_ratio,
        m.hybrid_layer_pattern,
        m.hybrid_override_pattern,
    )


class AttentionLayer(ResidualLayer):
    """`*`: x + dropout(self_attention(input_layernorm(x)))."""

    def __init__(self, config, pctx: ParallelContext, layer_number: int, rng: ModelParallelRNG):
        super().__init__(config, layer_number, rng)
        self.input_layernorm = Norm(config, pctx)
        self.self_attention = SelfAttention(config, pctx, layer_number, rng)

    def forward(self, x, attention_mask=None, rotary=None, inference_cache=None):
        branch = self.self_attention(
            self.input_layernorm(x), attention_mask, rotary, inference_cache=inference_cache
        )
        return self.residual_add(x, branch)


class MLPLayer(ResidualLayer):
    """`-`: x + dropout(mlp(pre_mlp_layernorm(x)))."""

    def __init__(self, config, pctx: ParallelContext, layer_number: int, rng: ModelParallelRNG):
        super().__init__(config, layer_number, rng)
        self.pre_mlp_layernorm = Norm(config, pctx)
        self.mlp = MLPBlock(config, pctx, layer_number, rng)

    def forward(self, x, attention_mask=None, rotary=None, inference_cache=None):
        return self.residual_add(x, self.mlp(self.pre_mlp_layernorm(x)))


def hybrid_layer_builder(pattern: str, mamba: MambaSpec):
    """The block's `layer_builder`: layer number n (1-based) is of kind pattern[n - 1]."""

    def build(config: TransformerConfig, pctx: ParallelContext, number: int, rng) -> nn.Module:
        kind = pattern[number - 1]
        if kind == MAMBA:
            return MambaLayer(config, mamba, pctx, number, rng)
        if kind == ATTENTION:
            return AttentionLayer(config, pctx, number, rng)
        if kind == MLP:
            return MLPLayer(config, pctx, number, rng)
        raise ValueError(f"layer kind {kind!r}")  # resolve_pattern admits only the three

    return build


def build_model(cfg, pctx: ParallelContext, vocab_size: int | None = None) -> list[GPTModel]:
    """This rank's chunks of the hybrid model, initialised identically to the one-process model
    (the pipeline split is GPT's: by layer count, whatever the kinds)."""
    mup.check_mup(cfg, "hybrid (Mamba)")
    pattern = hybrid_pattern(cfg)
    config = TransformerConfig.from_config(cfg)
    builder = hybrid_layer_builder(pattern, MambaSpec.from_config(cfg))

    def make_chunk(padded, pre_process, post_process, layers, rng):
        return GPTModel(
            config, pctx, padded, pre_process, post_process, layers, rng, layer_builder=builder
        )

    chunks = build_model_chunks(cfg, pctx, vocab_size, make_chunk)
    for chunk in chunks:
        chunk.hybrid_pattern = pattern
    return chunks
