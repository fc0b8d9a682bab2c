"""Analytic parameter counts of the GPT that `build_model` builds: in total and per rank."""

from __future__ import annotations

from dataclasses import dataclass

from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline import chunk_layer_ranges


@dataclass(frozen=True)
class ParameterCounts:
    """`total`: the full model (a tied output weight counted once, padded vocabulary);
    `per_stage[pp_rank]`: what one tensor-parallel rank of that pipeline stage holds (the last
    stage's copy of a tied embedding included); `this_rank`: per_stage of the given rank."""

    total: int
    embedding: int
    per_layer: int
    per_stage: list[int]
    this_rank: int
    padded_vocab_size: int


def _layer_counts(spec: TransformerConfig) -> tuple[int, int]:
    """(tensor-parallel-split, replicated) parameters of one transformer layer, full sizes."""
    h, hn = spec.hidden_size, spec.kv_channels
    bias = spec.add_bias_linear
    qkv_out = (spec.num_attention_heads + 2 * spec.num_query_groups) * hn
    fc1_out = spec.ffn_hidden_size * (2 if spec.swiglu else 1)
    split = h * qkv_out + spec.num_attention_heads * hn * h + h * fc1_out + spec.ffn_hidden_size * h
    if bias or spec.add_qkv_bias:
        split += qkv_out
    if bias:
        split += fc1_out
    replicated = 2 * _norm_count(spec) + (2 * h if bias else 0)  # norms, proj and fc2 biases
    return split, replicated


def _norm_count(spec: TransformerConfig) -> int:
    return spec.hidden_size * (2 if spec.normalization == "LayerNorm" else 1)


def count_parameters(
    cfg, vocab_size: int | None = None, pctx: ParallelContext | None = None
) -> ParameterCounts:
    """Count without building: the layout comes from `pctx` when given, else from
    cfg.parallel (rank 0). `vocab_size` is the tokenizer's (padded as build_model pads it)."""
    from gigatron.models.embedding import resolve_vocab_size

    spec = TransformerConfig.from_config(cfg)
    p = cfg.parallel
    tp = pctx.tp_size if pctx is not None else p.tensor_model_parallel_size
    pp = pctx.pp_size if pctx is not None else p.pipeline_model_parallel_size
    pp_rank = pctx.pp_rank if pctx is not None else 0
    vocab = resolve_vocab_size(cfg, tp, vocab_size)
    h = spec.hidden_size
    tied = not spec.untie_embeddings_and_output_weights

    layer_split, layer_replicated = _layer_counts(spec)
    positions = (
        spec.max_position_embeddings * h
        if spec.position_embedding_type == "learned_absolute"
        else 0
    )
    embedding = vocab * h + positions
    total = (
        embedding
        + spec.num_layers * (layer_split + layer_replicated)
        + _norm_count(spec)
        + (0 if tied else vocab * h)
    )

    ranges = chunk_layer_ranges(
        spec.num_layers,
        pp,
        p.num_virtual_stages_per_pipeline_rank,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
    )
    per_stage = []
    for stage, chunks in enumerate(ranges):
        layers = sum(len(r) for r in chunks)
        count = layers * (layer_split // tp + layer_replicated)
        if stage == 0:
            count += vocab * h // tp + positions
        if stage == pp - 1:
            count += _norm_count(spec)
            if not tied or pp > 1:
                count += vocab * h // tp
        per_stage.append(count)
    return ParameterCounts(
        total=total,
        embedding=embedding,
        per_layer=layer_split + layer_replicated,
        per_stage=per_stage,
        this_rank=per_stage[pp_rank],
        padded_vocab_size=vocab,
    )
