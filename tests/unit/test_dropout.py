"""models/dropout.py: the CPU dropout mask from 16-bit random lanes (its rate, scale, gradient and
determinism), where it is not used, the same mask inside a compiled graph
(the core attention's: test_cpu_attention.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gigatron.models.dropout import LANES, dropout, keep_mask


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


def _dropout_and_grads(fn, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1, 1, 4097).view(17, 241).requires_grad_()
    torch.manual_seed(seed)
    y = fn(x)
    (y * y.detach().cos()).sum().backward()
    return y.detach(), x.grad


def _checkpointed(x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda t: dropout(t.sin(), 0.3).exp(), x, use_reentrant=False)


@pytest.mark.parametrize("fn", [lambda t: dropout(t.sin(), 0.3).exp(), _checkpointed])
def test_a_compiled_graph_draws_the_same_cpu_mask_as_eager(fn):
    """Inside a compiled graph (inductor) the operator draws the eager mask from the default
    generator, also when dynamo's checkpoint recomputes it in backward."""
    eager = _dropout_and_grads(fn)
    torch._dynamo.reset()
    compiled = _dropout_and_grads(torch.compile(fn, backend="inductor"))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert not torch.equal(_dropout_and_grads(fn, seed=1)[0], eager[0])  # the mask acts
