"""The analytic parameter count equals the parameters build_model creates, per rank and in total."""

from __future__ import annotations

import pytest

from gigatron.config.root import GigatronConfig
from gigatron.models import build_model
from gigatron.models.params import count_parameters
from gigatron.parallel.context import Grid, ParallelContext
from helpers import TINY_MLA

SHAPES = {
    "gpt2": dict(num_attention_heads=4),
    "llama-gqa": dict(
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
        position_embedding_type="rope",
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    ),
    "qkv-bias-no-pos": dict(
        num_attention_heads=4,
        add_bias_linear=False,
        add_qkv_bias=True,
        position_embedding_type="none",
        ffn_hidden_size=96,
    ),
    "gpt-oss-attention": dict(
        num_attention_heads=4,
        normalization="RMSNorm",
        quick_geglu=True,
        qk_layernorm=True,
        softmax_type="learnable",
        window_size="(7,0)",
        window_attn_skip_freq="2",
    ),
    "mla": dict(num_attention_heads=4, **TINY_MLA),
    "mtp": dict(num_attention_heads=4, mtp_num_layers=2, position_embedding_type="rope"),
    "mtp-untied": dict(
        num_attention_heads=4,
        mtp_num_layers=1,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
    ),
    "mla-no-q-latent": dict(
        num_attention_heads=4,
        multi_latent_attention=True,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        add_bias_linear=False,
    ),
}
LAYOUTS = [
    dict(tp=1, pp=1),
    dict(tp=2, pp=1),
    dict(tp=2, pp=2),
    dict(tp=1, pp=2, vp=2),
    dict(tp=2, pp=2, first=1),
]


def _config(shape: str, layout: dict) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.seq_length = 4, 64, 16
    for key, value in SHAPES[shape].items():
        setattr(m, key, value)
    cfg.parallel.tensor_model_parallel_size = layout["tp"]
    cfg.parallel.pipeline_model_parallel_size = layout["pp"]
    cfg.parallel.num_virtual_stages_per_pipeline_rank = layout.get("vp")
    cfg.parallel.decoder_first_pipeline_num_layers = layout.get("first")
    if "first" in layout:
        cfg.parallel.decoder_last_pipeline_num_layers = m.num_layers - layout["first"]
    cfg.model.make_vocab_size_divisible_by = 8
    return cfg


@pytest.mark.parametrize("shape", SHAPES)
def test_count_matches_built_model(shape):
    vocab = 100
    single_cfg = _config(shape, LAYOUTS[0])
    (single,) = build_model(single_cfg, ParallelContext.single(), vocab_size=vocab)
    counts = count_parameters(single_cfg, vocab)
    assert counts.total == sum(p.numel() for p in single.parameters())
    assert counts.padded_vocab_size == 104

    for layout in LAYOUTS[1:]:
        cfg = _config(shape, layout)
        tp, pp = layout["tp"], layout["pp"]
        unique = 0
        for rank in range(tp * pp):
            pctx = ParallelContext(grid=Grid(tp=tp, pp=pp), rank=rank)
            chunks = build_model(cfg, pctx, vocab_size=vocab)
            held = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            assert count_parameters(cfg, vocab, pctx).this_rank == held, (layout, rank)
            for chunk in chunks:
                for param in chunk.parameters():
                    # Split weights count on every tp rank, replicated ones on tp rank 0; the
                    # last stage's tied copy is not a parameter of its own.
                    if getattr(param, "shared_embedding", False) and not chunk.pre_process:
                        continue
                    if param.tensor_model_parallel or pctx.tp_rank == 0:
                        unique += param.numel()
        layout_counts = count_parameters(cfg, vocab)
        assert layout_counts.total == unique, layout
        assert len(layout_counts.per_stage) == pp


def test_known_model_sizes():
    cfg = GigatronConfig()
    cfg.model.model_preset = "llama2-7b"
    from gigatron.config.validate import finalize_config

    finalize_config(cfg)
    assert count_parameters(cfg, 32000).total == 6_738_415_616  # Llama-2-7b's published count
    cfg = GigatronConfig()
    cfg.model.model_preset = "gpt2-124m"
    finalize_config(cfg)
    # GPT-2 small has 124,439,808 parameters at vocabulary 50257; padding to 50304 adds 47 rows.
    assert count_parameters(cfg, 50257).total == 124_439_808 + 47 * 768


def test_moe_counts_total_active_and_per_rank():
    from gigatron.checkpoint.convert import offline_context

    def config(**sizes) -> GigatronConfig:
        cfg = _config("llama-gqa", dict(tp=sizes.get("tp", 1), pp=sizes.get("pp", 1)))
        e = cfg.moe
        e.num_experts, e.moe_router_topk, e.moe_layer_freq = 4, 2, "[1,0,1,1]"
        e.moe_ffn_hidden_size, e.moe_shared_expert_intermediate_size = 32, 16
        e.moe_shared_expert_gate = True
        cfg.parallel.expert_model_parallel_size = sizes.get("ep", 1)
        cfg.parallel.expert_tensor_parallel_size = sizes.get("etp")
        return cfg

    vocab = 100
    cfg = config()
    (single,) = build_model(cfg, ParallelContext.single(), vocab_size=vocab)
    counts = count_parameters(cfg, vocab)
    assert counts.total == sum(p.numel() for p in single.parameters())
    # 3 MoE layers of 4 experts, each h * 2F + F * h = 64 * 64 + 32 * 64; a token uses 2 of 4.
    experts_per_layer = 4 * (64 * 64 + 32 * 64)
    assert counts.active == counts.total - 3 * experts_per_layer // 2
    for sizes in (
        dict(ep=2, dp=2),
        dict(tp=2, ep=2, dp=2),
        dict(tp=2, ep=2, etp=1),
        dict(pp=2, ep=2, dp=2),
    ):
        grid = Grid(
            tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), dp=sizes.get("dp", 1),
            ep=sizes["ep"], etp=sizes.get("etp"),
        )  # fmt: skip
        cfg = config(**sizes)
        for rank in range(grid.world_size):
            pctx = offline_context(grid, rank)
            chunks = build_model(cfg, pctx, vocab_size=vocab)
            held = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            assert count_parameters(cfg, vocab, pctx).this_rank == held, (sizes, rank)


def test_moe_with_multi_token_prediction_counts():
    cfg = _config("llama-gqa", LAYOUTS[0])
    e = cfg.moe
    e.num_experts, e.moe_router_topk, e.moe_layer_freq, e.moe_ffn_hidden_size = 4, 2, "1", 32
    cfg.model.mtp_num_layers = 1
    (single,) = build_model(cfg, ParallelContext.single(), vocab_size=100)
    counts = count_parameters(cfg, 100)
    assert counts.total == sum(p.numel() for p in single.parameters())
    # 4 decoder MoE layers and the MTP layer's, each 4 experts of 64 * 64 + 32 * 64; a token
    # uses 2 of 4.
    assert counts.active == counts.total - 5 * 4 * (64 * 64 + 32 * 64) // 2


def test_moe_with_biases_counts_router_and_expert_biases():
    from gigatron.checkpoint.convert import offline_context

    def config(ep: int = 1) -> GigatronConfig:
        cfg = _config("gpt2", LAYOUTS[0])
        e = cfg.moe
        e.num_experts, e.moe_router_topk, e.moe_ffn_hidden_size = 4, 2, 32
        e.moe_shared_expert_intermediate_size = 16
        cfg.parallel.expert_model_parallel_size = ep
        return cfg

    (single,) = build_model(config(), ParallelContext.single(), vocab_size=100)
    assert count_parameters(config(), 100).total == sum(p.numel() for p in single.parameters())
    grid = Grid(tp=1, pp=1, dp=2, ep=2)
    for rank in range(2):
        chunks = build_model(config(ep=2), offline_context(grid, rank), vocab_size=100)
        held = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        pctx = offline_context(grid, rank)
        assert count_parameters(config(ep=2), 100, pctx).this_rank == held
