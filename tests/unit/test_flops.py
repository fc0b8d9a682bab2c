"""Model FLOPs per iteration and MFU against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from gigatron.config import parse_config
from gigatron.families.gpt.flops import mla_flops_per_token, model_flops_per_iteration
from gigatron.models.flops import device_peak_flops, forward_flops_per_token, mfu


def test_plain_gpt_matches_the_megatron_paper_formula():
    b, s, layers, h, v = 8, 1024, 12, 768, 50304
    cfg = parse_config(
        ["--num-layers", str(layers), "--hidden-size", str(h), "--num-attention-heads", "12",
         "--seq-length", str(s)]
    )  # fmt: skip
    expected = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    assert model_flops_per_iteration(cfg.model, b, v) == pytest.approx(expected, rel=1e-12)


def test_gqa_swiglu_hand_count():
    # Per layer and token: qkv 2*64*(64+2*32) = 16384, scores+values 4*8*64 = 2048,
    # projection 2*64*64 = 8192, SwiGLU 2*3*64*128 = 49152 -> 75776; two layers 151552;
    # logits 2*64*100 = 12800 -> 164352 forward FLOPs per token.
    per_token = forward_flops_per_token(
        num_layers=2, hidden_size=64, seq_length=8, vocab_size=100, ffn_hidden_size=128,
        num_attention_heads=4, num_query_groups=2, kv_channels=16, swiglu=True,
    )  # fmt: skip
    assert per_token == 164352
    cfg = parse_config(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--ffn-hidden-size", "128", "--seq-length", "8"]
    )  # fmt: skip
    assert model_flops_per_iteration(cfg.model, 3, 100) == 3 * 164352 * 3 * 8


def test_mfu_and_peaks():
    assert mfu(1e15, 1.0, 2, 989e12) == pytest.approx(1e15 / (2 * 989e12))
    assert mfu(1e15, 1.0, 2, None) is None
    assert device_peak_flops(torch.device("cpu"), "bf16") is None


def test_moe_counts_the_experts_a_token_uses():
    # The GQA/SwiGLU model above with layer 0 an MoE layer of 8 experts of 32, top-2, and a
    # shared expert of 64: its MLP works like a dense one of 2 * 32 + 64 = 128 (layer 1 is
    # dense with 128 too), so the count is unchanged; with top-4 it is 4 * 32 + 64 = 192:
    # + 2*3*64*64 = 24576 per token.
    from gigatron.families import get_family

    argv = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu",
        "--ffn-hidden-size", "128", "--seq-length", "8", "--disable-bias-linear",
        "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[1,0]",
        "--moe-shared-expert-intermediate-size", "64",
    ]  # fmt: skip
    gpt = get_family("gpt")
    cfg = parse_config([*argv, "--moe-router-topk", "2"])
    assert gpt.flops_per_iteration(cfg, 3, 100) == 3 * 164352 * 3 * 8
    cfg = parse_config([*argv, "--moe-router-topk", "4"])
    assert gpt.flops_per_iteration(cfg, 3, 100) == 3 * (164352 + 24576) * 3 * 8


def test_multi_latent_attention_hand_count():
    # Per token: query 64*24 + 24*4*(8+8) = 3072; key/value 64*(16+8) + 16*4*(8+12) = 2816;
    # Q.K^T and P.V 8*4*(16+12) = 896; output 4*12*64 = 3072 -> 2 * 9856 = 19712.
    cfg = parse_config(
        ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "8", "--multi-latent-attention", "--q-lora-rank", "24",
         "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
         "--v-head-dim", "12"]
    )  # fmt: skip
    assert mla_flops_per_token(cfg.model) == 19712
    dense = model_flops_per_iteration(cfg.model, 1, 100)
    mlp_and_logits = 2 * 2 * 64 * 256 + 2 * 64 * 100
    assert dense == 3 * (19712 + mlp_and_logits) * 8


def test_multi_token_prediction_adds_its_layers_projections_and_logits():
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "8"]  # fmt: skip
    plain = model_flops_per_iteration(parse_config(argv).model, 1, 100)
    with_mtp = model_flops_per_iteration(
        parse_config([*argv, "--mtp-num-layers", "1"]).model, 1, 100
    )
    three_layers = model_flops_per_iteration(
        parse_config([*argv[:1], "3", *argv[2:]]).model, 1, 100
    )
    # One more layer, eh_proj 2 * 2h * h and logits 2 * h * V per token, x 3 (fwd + bwd) x s.
    assert with_mtp == three_layers + 3 * 8 * (2 * 2 * 64 * 64 + 2 * 64 * 100)
    assert with_mtp > plain
