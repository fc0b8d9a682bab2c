"""Analytic parameter counts of the GPT that `build_model` builds: in total and per rank, and
the active parameters of an MoE model (those one token uses: top-k of each layer's experts)."""

from __future__ import annotations

from dataclasses import dataclass

from gigatron.models.embedding import resolve_vocab_size
from gigatron.models.moe.spec import MoESpec
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline import chunk_layer_ranges


@dataclass(frozen=True)
class ParameterCounts:
    """`total`: the full model (a tied output weight counted once, padded vocabulary);
    `per_stage[pp_rank]`: what one tensor-parallel rank of that pipeline stage holds (the last
    stage's copy of a tied embedding included); `this_rank`: per_stage of the given rank;
    `active`: total without the experts a token skips (= total for a dense model); `per_layer`:
    a dense layer's count."""

    total: int
    embedding: int
    per_layer: int
    per_stage: list[int]
    this_rank: int
    padded_vocab_size: int
    active: int = 0


def _layer_counts(spec: TransformerConfig) -> tuple[int, int]:
    """(tensor-parallel-split, replicated) parameters of one transformer layer, full sizes."""
    split, replicated = _attention_counts(spec)
    mlp_split, mlp_replicated = _dense_mlp_counts(spec)
    return split + mlp_split, replicated + mlp_replicated


def _mla_counts(spec: TransformerConfig) -> tuple[int, int]:
    """Multi-latent attention (without the layer norms): (tensor-parallel-split, replicated)."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    q_out = heads * (spec.qk_head_dim + spec.qk_pos_emb_head_dim)
    kv_rank, q_rank = spec.kv_lora_rank, spec.q_lora_rank
    split = kv_rank * heads * (spec.qk_head_dim + spec.v_head_dim) + heads * spec.v_head_dim * h
    split += (q_rank or h) * q_out
    replicated = h * (kv_rank + spec.qk_pos_emb_head_dim) + (h * q_rank if q_rank else 0)
    if spec.qk_layernorm:
        replicated += _norm_count(spec, kv_rank) + (_norm_count(spec, q_rank) if q_rank else 0)
    return split, replicated


def _attention_counts(spec: TransformerConfig) -> tuple[int, int]:
    """Attention and the two norms: (tensor-parallel-split, replicated)."""
    if spec.multi_latent_attention:
        split, replicated = _mla_counts(spec)
        replicated += 2 * _norm_count(spec) + (spec.hidden_size if spec.add_bias_linear else 0)
        return split + (
            spec.num_attention_heads if spec.softmax_type == "learnable" else 0
        ), replicated
    h, hn = spec.hidden_size, spec.kv_channels
    bias = spec.add_bias_linear
    qkv_out = (spec.num_attention_heads + 2 * spec.num_query_groups) * hn
    split = h * qkv_out + spec.num_attention_heads * hn * h
    if bias or spec.add_qkv_bias:
        split += qkv_out
    replicated = 2 * _norm_count(spec) + (h if bias else 0)  # norms, proj bias
    if spec.qk_layernorm:
        replicated += 2 * _norm_count(spec, hn)
    if spec.softmax_type == "learnable":
        split += spec.num_attention_heads
    return split, replicated


def _dense_mlp_counts(spec: TransformerConfig, ffn: int | None = None) -> tuple[int, int]:
    h, ffn = spec.hidden_size, ffn or spec.ffn_hidden_size
    fc1_out = ffn * (2 if spec.gated_linear_unit else 1)
    split = h * fc1_out + ffn * h + (fc1_out if spec.add_bias_linear else 0)
    return split, (h if spec.add_bias_linear else 0)  # fc2 bias


def _moe_mlp_counts(spec: TransformerConfig, moe) -> tuple[int, int, int]:
    """An MoE layer's MLP: (tp-split shared experts, replicated router, gate and shared fc2 bias,
    all experts). With `add_bias_linear` the router and every expert have biases."""
    h = spec.hidden_size
    bias = spec.add_bias_linear
    shared_split = 0
    replicated = moe.num_experts * h + (moe.num_experts if bias else 0)
    if moe.shared_expert_size:
        shared_split, shared_replicated = _dense_mlp_counts(spec, moe.shared_expert_size)
        replicated += shared_replicated + (h if moe.shared_expert_gate else 0)
    expert_split, expert_fc2_bias = _dense_mlp_counts(spec, moe.ffn_hidden_size)
    return shared_split, replicated, moe.num_experts * (expert_split + expert_fc2_bias)


def _norm_count(spec: TransformerConfig, size: int | None = None) -> int:
    return (size or spec.hidden_size) * (2 if spec.normalization == "LayerNorm" else 1)


@dataclass(frozen=True)
class _Layout:
    """The parallel sizes a count is for: this rank's (`pctx`) or rank 0 of cfg.parallel's."""

    tp: int
    pp: int
    pp_rank: int
    ep: int
    etp: int

    @classmethod
    def of(cls, cfg, pctx: ParallelContext | None) -> _Layout:
        if pctx is not None:
            return cls(pctx.tp_size, pctx.pp_size, pctx.pp_rank, pctx.ep_size, pctx.etp_size)
        p = cfg.parallel
        tp = p.tensor_model_parallel_size
        etp = p.expert_tensor_parallel_size or tp
        return cls(tp, p.pipeline_model_parallel_size, 0, p.expert_model_parallel_size, etp)


class _LayerCounter:
    """Parameters of the decoder's layers (and MTP layers) that one rank holds."""

    def __init__(self, spec: TransformerConfig, moe: MoESpec | None) -> None:
        self.spec, self.moe = spec, moe
        self.attention = _attention_counts(spec)
        self.dense = _dense_mlp_counts(spec)

    def layer(self, index: int, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
        """Parameters of layer `index` one rank holds (all of them with sizes 1)."""
        attention_split, attention_replicated = self.attention
        count = attention_split // tp + attention_replicated
        if self.moe is not None and self.moe.is_moe_layer(index + 1):
            shared, replicated, experts = _moe_mlp_counts(self.spec, self.moe)
            return count + shared // tp + replicated + experts // (ep * etp)
        return count + self.dense[0] // tp + self.dense[1]

    def mtp(self, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
        """Multi-token prediction layers (last stage): 3 norms, eh_proj [h, 2h], a layer."""
        spec = self.spec
        depths = range(spec.num_layers, spec.num_layers + (spec.mtp_num_layers or 0))
        per_depth = 3 * _norm_count(spec) + 2 * spec.hidden_size * spec.hidden_size // tp
        return sum(per_depth + self.layer(i, tp, ep, etp) for i in depths)

    def skipped_experts(self) -> int:
        """Expert parameters a token does not use (all but top-k of each MoE layer's)."""
        if self.moe is None:
            return 0
        experts = _moe_mlp_counts(self.spec, self.moe)[2]
        skipped = len(self.moe.moe_layer_numbers) * experts * (self.moe.num_experts - self.moe.topk)
        return skipped // self.moe.num_experts


def _per_stage(cfg, counter: _LayerCounter, layout: _Layout, vocab: int, positions: int):
    """What one tensor-parallel rank of each pipeline stage holds."""
    spec, p = counter.spec, cfg.parallel
    tp, pp, h = layout.tp, layout.pp, spec.hidden_size
    tied = not spec.untie_embeddings_and_output_weights
    ranges = chunk_layer_ranges(
        spec.num_layers,
        pp,
        p.num_virtual_stages_per_pipeline_rank,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
        getattr(p, "pipeline_schedule", "1f1b") == "dualpipev",
    )
    # DualPipeV's V ends on rank 0, which then holds the output layer.
    output_stage = 0 if getattr(p, "pipeline_schedule", "1f1b") == "dualpipev" else pp - 1
    per_stage = []
    for stage, chunks in enumerate(ranges):
        count = sum(counter.layer(i, tp, layout.ep, layout.etp) for r in chunks for i in r)
        if stage == 0:
            count += vocab * h // tp + positions
        if stage == output_stage:
            count += _norm_count(spec) + counter.mtp(tp, layout.ep, layout.etp)
            if not tied or pp > 1:
                count += vocab * h // tp
            if spec.mtp_num_layers and pp > 1 and not tied:
                count += vocab * h // tp  # the MTP stage's copy of the word embedding
        per_stage.append(count)
    return per_stage


def count_parameters(
    cfg, vocab_size: int | None = None, pctx: ParallelContext | None = None
) -> ParameterCounts:
    """Count without building: the layout comes from `pctx` when given, else from
    cfg.parallel (rank 0). `vocab_size` is the tokenizer's (padded as build_model pads it)."""
    spec = TransformerConfig.from_config(cfg)
    layout = _Layout.of(cfg, pctx)
    vocab = resolve_vocab_size(cfg, layout.tp, vocab_size)
    h = spec.hidden_size
    tied = not spec.untie_embeddings_and_output_weights
    counter = _LayerCounter(spec, MoESpec.from_config(cfg))
    positions = (
        spec.max_position_embeddings * h
        if spec.position_embedding_type == "learned_absolute"
        else 0
    )
    embedding = vocab * h + positions
    layers_total = sum(counter.layer(i) for i in range(spec.num_layers))
    total = embedding + layers_total + _norm_count(spec) + (0 if tied else vocab * h)
    total += counter.mtp()
    per_stage = _per_stage(cfg, counter, layout, vocab, positions)
    return ParameterCounts(
        total=total,
        embedding=embedding,
        per_layer=sum(_layer_counts(spec)),
        per_stage=per_stage,
        this_rank=per_stage[layout.pp_rank],
        padded_vocab_size=vocab,
        active=total - counter.skipped_experts(),
    )
