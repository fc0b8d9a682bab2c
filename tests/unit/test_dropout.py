"""models/dropout.py: the CPU dropout mask from 16-bit random lanes (its rate, scale, gradient and
determinism), `F.dropout` where it is not used, and the core attention's dropout on CPU equal to
softmax by hand with the same mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_transformer import tiny_config

from gigatron.models import build_model
from gigatron.models.dropout import LANES, dropout, keep_mask
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG


@pytest.mark.parametrize("p", [0.1, 0.5, 0.03])
def test_the_mask_drops_at_the_rate_and_scales_the_kept_exactly(p):
    x = torch.rand(2_000_003) + 1  # no zeros: a zero out is a dropped element
    torch.manual_seed(1)
    y = dropout(x, p)
    dropped = round(p * LANES) / LANES
    assert abs(dropped - p) <= 2**-17
    rate = (y == 0).double().mean().item()
    assert abs(rate - dropped) < 5 * math.sqrt(dropped * (1 - dropped) / x.numel())
    kept = y != 0
    assert torch.equal(y[kept], x[kept] * (1 / (1 - dropped)))
    assert abs(y.double().mean().item() / x.double().mean().item() - 1) < 3e-3


def test_the_gradient_is_the_mask_times_the_scale_and_a_seed_repeats_the_mask():
    x = torch.randn(64, 257, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x, 0.25)
    y.backward(torch.ones_like(y))
    torch.manual_seed(3)
    keep, scale = keep_mask(x.shape, 0.25)
    assert scale == LANES / (LANES - LANES // 4)
    assert torch.equal(x.grad, keep.float() * scale)
    assert torch.equal(y.detach(), torch.where(keep, x.detach(), 0.0) * scale)
    assert not torch.equal(keep, keep_mask(x.shape, 0.25)[0])  # the generator moved on


def test_f_dropout_where_the_cheap_mask_does_not_apply():
    x = torch.randn(100)
    assert torch.equal(dropout(x, 0.5, training=False), x)
    assert torch.equal(dropout(x, 0.0), x)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    torch.manual_seed(0)
    compiled = torch.compile(lambda t: dropout(t, 0.5), backend="eager")(x)
    torch.manual_seed(0)
    assert torch.equal(compiled, F.dropout(x, 0.5))  # inside a graph: F.dropout's draw


def test_core_attention_dropout_on_cpu_is_softmax_by_hand_with_the_mask():
    cfg = tiny_config(attention_dropout=0.3)
    (model,) = build_model(cfg, ParallelContext.single())
    core = model.get_submodule("decoder.layers.0.self_attention.core_attention").train()
    s, b, heads, dim = 16, 2, 4, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, heads, dim, generator=g) for _ in range(3))
    state = core.rng.get_state()
    out = core(q, k, v, None)
    rng = ModelParallelRNG(0)
    rng.set_state(state)
    with rng.fork():  # the model-parallel stream the attention draws from
        keep, scale = keep_mask(torch.Size((b, heads, s, s)), 0.3)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = qb @ kb.transpose(-1, -2) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    by_hand = (torch.where(keep, scores.softmax(-1), 0.0) @ vb) * scale
    torch.testing.assert_close(out, by_hand.permute(2, 0, 1, 3).reshape(s, b, -1))
    core.eval()
    assert not torch.allclose(core(q, k, v, None), out)  # dropout really acted
