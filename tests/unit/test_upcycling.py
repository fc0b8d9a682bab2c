"""MoE upcycling (checkpoint/upcycling.py): a dense GPT checkpoint becomes an MoE model whose
logits equal the dense model's (each expert a copy of the dense MLP, routing probabilities
summing to one), through the checkpoint the run would load; the refused settings."""

from __future__ import annotations

import pytest
import torch

from gigatron.checkpoint.formats import save_checkpoint
from gigatron.checkpoint.upcycling import upcycle, upcycling_problems
from gigatron.config.root import parse_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "100",
        "--swiglu", "--ffn-hidden-size", "96", "--hidden-dropout", "0",
        "--attention-dropout", "0"]  # fmt: skip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-use-upcycling"]


def _build(cfg, pctx):
    return get_family("gpt").build_model(cfg, pctx, 100)


def _logits(chunk, tokens):
    with torch.no_grad():
        return chunk(tokens, torch.arange(16).expand(tokens.shape[0], 16)).float()


def test_upcycled_logits_equal_the_dense_model(tmp_path):
    pctx = ParallelContext.single()
    dense_cfg = parse_config([*TINY, "--seed", "7"])
    (dense,) = _build(dense_cfg, pctx)
    save_checkpoint(tmp_path, 3, [dense], None, None, pctx, dense_cfg)
    cfg = parse_config([*TINY, *MOE, "--load", str(tmp_path), "--moe-layer-freq", "[1,0]"])
    (moe,) = _build(cfg, pctx)
    router = moe.decoder.layers["0"].mlp.router.weight.detach().clone()
    line = upcycle(cfg, pctx, [moe], _build)
    assert "iteration 3" in line and "4 experts" in line
    tokens = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    want = _logits(dense, tokens)
    got = _logits(moe, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(moe.decoder.layers["0"].mlp.router.weight, router)  # its own init
    experts = moe.decoder.layers["0"].mlp.experts.linear_fc1.weight
    assert all(torch.equal(e, dense.decoder.layers["0"].mlp.linear_fc1.weight) for e in experts)
    # pre-softmax top-2 routing does not sum to one: refused, not silently different
    with pytest.raises(GigatronError, match="sum to one"):
        upcycle(parse_config([*TINY, *MOE, "--load", str(tmp_path), "--moe-router-pre-softmax"]),
                pctx, [moe], _build)  # fmt: skip


def test_upcycling_rules():
    cfg = parse_config([*TINY, *MOE, "--moe-upcycling-granularity", "2"])
    problems = " ".join(upcycling_problems(cfg))
    assert "needs --load" in problems and "granularity 2" in problems
