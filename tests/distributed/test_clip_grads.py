"""Global grad norm, clipping, zero counting and overflow checks across tp / pp / sharded dp:
sharded gradients give the numbers of the full tensors on one process."""

import math

import pytest
import torch

from gigatron.optim.clip_grads import clip_grad_norm, count_zeros, unscale_and_check_overflow
from gigatron.parallel.context import ParallelContext, run_distributed

pytestmark = pytest.mark.distributed


def full_grads():
    """The full-model gradients, the same in every process (seeded)."""
    g = torch.Generator().manual_seed(0)
    grads = {
        "embedding": torch.randn(12, 6, generator=g),  # vocab-parallel, tied with the output
        "fc1": torch.randn(8, 6, generator=g),  # column-parallel: split on dim 0
        "fc1_bias": torch.randn(8, generator=g),  # column-parallel bias: split on dim 0
        "fc2": torch.randn(6, 8, generator=g),  # row-parallel: split on dim 1
        "fc2_bias": torch.randn(6, generator=g),  # replicated over tp
        "norm": torch.randn(6, generator=g),  # replicated over tp
    }
    grads["norm"][:2] = 0.0
    return grads


def reference(max_norm):
    grads = full_grads()
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    zeros = sum(int((g == 0).sum()) for g in grads.values())
    coeff = min(1.0, max_norm / (norm + 1e-6))
    return norm, zeros, {k: g * coeff for k, g in grads.items()}


def make_param(value, tensor_parallel, shared=False):
    param = torch.nn.Parameter(torch.zeros_like(value))
    param.grad = value.clone()
    param.tensor_model_parallel = tensor_parallel
    if shared:
        param.shared_embedding = True
    return param


def local_params(pctx):
    """This rank's shards. With pp = 2 stage 0 holds embedding + fc1, stage 1 fc2 + norm + the
    tied output weight (a second copy of the embedding gradient)."""
    tp, r = pctx.tp_size, pctx.tp_rank
    grads = full_grads()

    def shard(t, dim):
        return t.chunk(tp, dim=dim)[r]

    params = {
        "embedding": make_param(shard(grads["embedding"], 0), True, shared=pctx.pp_size > 1),
        "fc1": make_param(shard(grads["fc1"], 0), True),
        "fc1_bias": make_param(shard(grads["fc1_bias"], 0), True),
        "fc2": make_param(shard(grads["fc2"], 1), True),
        "fc2_bias": make_param(grads["fc2_bias"], False),
        "norm": make_param(grads["norm"], False),
    }
    if pctx.pp_size == 1:
        return params, {k: (k, None) for k in params}
    if pctx.pp_rank == 0:
        names = ["embedding", "fc1", "fc1_bias"]
        return {k: params[k] for k in names}, {k: (k, None) for k in names}
    names = ["fc2", "fc2_bias", "norm"]
    stage = {k: params[k] for k in names}
    stage["output"] = make_param(shard(grads["embedding"], 0), True, shared=True)
    layout = {k: (k, None) for k in names}
    layout["output"] = ("embedding", None)
    return stage, layout


def check_sharded_model(pctx, max_norm):
    expected_norm, expected_zeros, clipped = reference(max_norm)
    params, layout = local_params(pctx)
    assert count_zeros(params.values(), pctx) == expected_zeros
    norm = clip_grad_norm(params.values(), max_norm, pctx)
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    for name, param in params.items():
        full_name, _ = layout[name]
        full = clipped[full_name]
        if param.tensor_model_parallel:
            dim = 1 if full_name == "fc2" else 0
            full = full.chunk(pctx.tp_size, dim=dim)[pctx.tp_rank]
        torch.testing.assert_close(param.grad, full, rtol=1e-6, atol=1e-7)


def _layouts(rank, world_size):
    pp_ctx = ParallelContext.from_sizes(pp=2)
    check_sharded_model(pp_ctx, max_norm=1.0)  # the tied embedding counted once
    params, _ = local_params(pp_ctx)
    inf_norm = clip_grad_norm(params.values(), 0.0, pp_ctx, norm_type=float("inf"))
    assert inf_norm == pytest.approx(max(float(g.abs().max()) for g in full_grads().values()))

    pctx = ParallelContext.from_sizes(tp=2)
    check_sharded_model(pctx, max_norm=1.0)
    check_sharded_model(pctx, max_norm=1e6)  # no clipping

    # overflow seen on one tp rank only: both ranks must skip
    grads = [torch.ones(3), torch.ones(2)]
    if rank == 1:
        grads[1][0] = float("nan")
    assert unscale_and_check_overflow(grads, torch.tensor([0.5]), pctx) is True
    assert torch.equal(grads[0], torch.full((3,), 0.5))
    clean = [torch.full((4,), 8.0)]
    assert unscale_and_check_overflow(clean, torch.tensor([0.25]), pctx) is False
    assert torch.equal(clean[0], torch.full((4,), 2.0))

    # dp = 2 with gradients sharded over dp (the distributed optimizer's case)
    dp_ctx = ParallelContext.from_sizes(tp=1)
    flat = torch.cat([g.flatten() for g in full_grads().values()])
    norm_full = float(flat.double().norm())
    half = flat.chunk(2)[dp_ctx.dp_rank]
    param = torch.nn.Parameter(torch.zeros_like(half))
    param.grad = half.clone()
    assert clip_grad_norm([param], 0.0, dp_ctx, sharded_group="dp") == pytest.approx(
        norm_full, rel=1e-6
    )
    # without the flag, dp ranks are taken as replicas and only the local half counts
    assert clip_grad_norm([param], 0.0, dp_ctx) == pytest.approx(
        float(half.double().norm()), rel=1e-6
    )


def test_single_process_reference():
    pctx = ParallelContext.single()
    check_sharded_model(pctx, max_norm=1.0)


def test_tp2_pp2_and_sharded_dp():
    # One spawn of 2 processes, three layouts of them: tp = 2, pp = 2, dp = 2 (process startup
    # dominates the cost on a 2-core machine).
    run_distributed(_layouts, 2)


def _expert_layouts(rank, world_size):
    """Expert weights: different experts on ep ranks, etp slices or etp replicas; the norm and
    the zero count are those of all experts plus the dense weights, each counted once, with or
    without the gradients sharded over the (expert-)data-parallel ranks."""
    g = torch.Generator().manual_seed(3)
    dense_full = torch.randn(8, generator=g)
    experts_full = torch.randn(4, 6, 8, generator=g)
    experts_full[1, :2] = 0.0
    expected = math.sqrt(float(dense_full.double().norm() ** 2 + experts_full.double().norm() ** 2))
    expected_zeros = 16  # experts_full[1, :2]: 2 x 8
    for sizes in (dict(tp=2, ep=2), dict(tp=2, ep=2, etp=1), dict(ep=4), dict(tp=2, ep=4, etp=1)):
        pctx = ParallelContext.from_sizes(**sizes)
        dense = make_param(dense_full, False)
        local = experts_full.chunk(pctx.ep_size)[pctx.ep_rank]
        local = local.chunk(pctx.etp_size, dim=1)[pctx.etp_rank]
        expert = make_param(local, True)
        expert.expert_parallel = True
        assert count_zeros([dense, expert], pctx) == expected_zeros, sizes
        assert clip_grad_norm([dense, expert], 0.0, pctx) == pytest.approx(expected, rel=1e-6)
        # Sharded over the data-parallel ranks (dense) and expert-data-parallel ranks (experts).
        dense_shard = dense_full.chunk(pctx.size("dp_cp"))[pctx.rank_in("dp_cp")]
        expert_shard = local.flatten().chunk(pctx.size("expert_dp"))[pctx.rank_in("expert_dp")]
        sharded = [make_param(dense_shard, False), make_param(expert_shard, True)]
        sharded[1].expert_parallel = True
        norm = clip_grad_norm(sharded, 0.0, pctx, sharded_group="dp_cp")
        assert norm == pytest.approx(expected, rel=1e-6), sizes
        # An overflow in one rank's experts stops every rank.
        grads = [torch.ones(2)]
        if rank == world_size - 1:
            grads[0][1] = float("inf")
        assert unscale_and_check_overflow(grads, torch.tensor([1.0]), pctx) is True


def test_expert_parallel_norm_counts_each_expert_once():
    run_distributed(_expert_layouts, 4)
