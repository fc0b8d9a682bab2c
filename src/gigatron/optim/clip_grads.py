"""Global gradient norm, clipping, zero counting and the fp16 overflow check, across every
parallel group.

Each weight is counted once in the norm:
- a weight replicated over tensor parallelism (no `tensor_model_parallel = True`) only on tp
  rank 0; tensor-parallel shards on every tp rank (together they are the full tensor);
- a weight held on several pipeline stages (`shared_embedding = True`: the word embedding and
  the tied output layer; `shared_position_embedding = True`: T5's position embedding) only on
  the first stage.
The squared sums are then all-reduced over the model group (tp x pp). Ranks of one data-parallel
group hold the same gradients, so dp is reduced only when the gradients are sharded over it (the
distributed optimizer passes `sharded_group`, e.g. "dp" or "dp_cp").

Expert weights (`expert_parallel = True`) differ between expert-parallel ranks and are split over
the expert-tensor-parallel group: counted on every rank holding a slice, only on expert-tp rank 0
when replicated there, and summed over expert-tp x ep x pp (x expert-dp when sharded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from gigatron.parallel.context import ParallelContext


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad`, or this rank's shard of it when it is a DTensor (FSDP2)."""
    grad = param.grad
    return grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad


def is_expert(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def counts_in_norm(param: torch.Tensor, pctx: ParallelContext) -> bool:
    """True when this rank's copy of `param` is the one counted in global statistics."""
    shared = getattr(param, "shared_embedding", False) or getattr(
        param, "shared_position_embedding", False
    )
    if shared and not pctx.is_pipeline_first_stage():
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (pctx.etp_rank if is_expert(param) else pctx.tp_rank) == 0


def grads_for_norm(params: Iterable[torch.Tensor], pctx: ParallelContext) -> list[torch.Tensor]:
    """The `.grad` of each parameter counted in the norm on this rank (see module docstring)."""
    return [local_grad(p) for p in params if p.grad is not None and counts_in_norm(p, pctx)]


def split_grads_for_norm(
    params: Iterable[torch.Tensor], pctx: ParallelContext
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense, expert) gradients counted in the norm on this rank."""
    dense, expert = [], []
    for p in params:
        if p.grad is not None and counts_in_norm(p, pctx):
            (expert if is_expert(p) else dense).append(local_grad(p))
    return dense, expert


def _has_expert_layout(pctx: ParallelContext) -> bool:
    """Whether expert weights need their own reduction (else they reduce like dense ones)."""
    return pctx.size("ep") > 1 or pctx.group_ranks["expert_tp"] != pctx.group_ranks["tp"]


def reduce_model_statistic(
    dense: torch.Tensor,
    expert: torch.Tensor,
    pctx: ParallelContext,
    sharded_group: str | None,
    op: Any = None,
) -> torch.Tensor:
    """A statistic of the whole model from this rank's dense and expert parts (1-element
    tensors): dense reduced over the model group [+ sharded group], expert over
    expert-tp x ep x pp [+ expert-dp]; their sum, or their max with op MAX."""
    is_max = op == dist.ReduceOp.MAX
    if not _has_expert_layout(pctx):
        total = torch.maximum(dense, expert) if is_max else dense + expert
        for name in _stat_groups(pctx, sharded_group):
            pctx.all_reduce(total, name, op=op)
        return total
    pair = torch.cat([dense.reshape(1), expert.reshape(1)])
    pctx.all_reduce(pair, "pp", op=op)
    dense, expert = pair[:1].clone(), pair[1:].clone()
    for name in ("tp", sharded_group):
        if name is not None:
            pctx.all_reduce(dense, name, op=op)
    for name in ("expert_tp", "ep", "expert_dp" if sharded_group is not None else None):
        if name is not None:
            pctx.all_reduce(expert, name, op=op)
    return torch.maximum(dense, expert) if is_max else dense + expert


def _stat_groups(pctx: ParallelContext, sharded_group: str | None) -> list[str]:
    names = ["model"]
    if sharded_group is not None:
        names.append(sharded_group)
    return names


def _local_norm(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    if norm_type == float("inf"):
        local = [g.detach().abs().max().float() for g in grads]
        total = torch.stack(local).max() if local else torch.zeros((), device=device)
        return total.reshape(1).to(device=device, dtype=torch.float32)
    powered = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        # One fused kernel per list (fp32 accumulation for low-precision gradients).
        fp32 = [g.detach() for g in grads if g.dtype == torch.float32]
        other = [g.detach().float() for g in grads if g.dtype != torch.float32]
        norms = [
            n for group in (fp32, other) if group for n in torch._foreach_norm(group, norm_type)
        ]
        powered += torch.stack(norms).pow(norm_type).sum().to(device)
    return powered


def grad_norm_tensor(
    grads: list[torch.Tensor],
    pctx: ParallelContext,
    norm_type: float = 2.0,
    sharded_group: str | None = None,
    expert_grads: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Norm of the gradients of the whole model (all ranks), accumulated in fp32, as a tensor on
    the run's device (no host synchronisation). `grads` are dense gradients, `expert_grads`
    those of expert weights (see the module docstring)."""
    expert_grads = expert_grads or []
    first = (grads or expert_grads)[:1]
    device = first[0].device if first else pctx.device
    dense = _local_norm(grads, norm_type, device).to(pctx.device)
    expert = _local_norm(expert_grads, norm_type, device).to(pctx.device)
    if norm_type == float("inf"):
        return reduce_model_statistic(dense, expert, pctx, sharded_group, dist.ReduceOp.MAX)[0]
    total = reduce_model_statistic(dense, expert, pctx, sharded_group)
    return total.double().pow(1.0 / norm_type)[0]


def get_grad_norm(
    grads: list[torch.Tensor],
    pctx: ParallelContext,
    norm_type: float = 2.0,
    sharded_group: str | None = None,
    expert_grads: list[torch.Tensor] | None = None,
) -> float:
    """`grad_norm_tensor` as a number."""
    return float(grad_norm_tensor(grads, pctx, norm_type, sharded_group, expert_grads).item())


def clip_grads_by_norm(params: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale every `.grad` in `params` by min(1, max_norm / (total_norm + 1e-6)); returns it."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        grads = [local_grad(p) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coeff)
    return min(coeff, 1.0)


def clip_grads_by_norm_tensor(
    params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor
) -> None:
    """`clip_grads_by_norm` with the norm left on the device: every gradient is multiplied by
    the clamped coefficient (by 1 when under `max_norm`), so nothing waits for the norm."""
    grads = [local_grad(p) for p in params if p.grad is not None]
    if grads:
        coeff = (max_norm / (total_norm.double() + 1.0e-6)).clamp(max=1.0)
        for group in _by_device_dtype(grads).values():
            torch._foreach_mul_(group, coeff.to(device=group[0].device, dtype=group[0].dtype))


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def clip_grad_norm_tensor(
    params: Iterable[torch.Tensor],
    max_norm: float,
    pctx: ParallelContext,
    sharded_group: str | None = None,
) -> torch.Tensor:
    """`clip_grad_norm` (2-norm) without a host synchronisation: the norm stays a device
    tensor (the training step's path; the loop reads it at log intervals)."""
    params = list(params)
    dense, expert = split_grads_for_norm(params, pctx)
    total = grad_norm_tensor(dense, pctx, 2.0, sharded_group, expert_grads=expert)
    if max_norm > 0.0:
        clip_grads_by_norm_tensor(params, max_norm, total)
    return total


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    pctx: ParallelContext,
    norm_type: float = 2.0,
    sharded_group: str | None = None,
) -> float:
    """Global grad norm of `params` (before clipping), then clip them to `max_norm` (if > 0)."""
    params = list(params)
    dense, expert = split_grads_for_norm(params, pctx)
    total = get_grad_norm(dense, pctx, norm_type, sharded_group, expert_grads=expert)
    if max_norm > 0.0:
        clip_grads_by_norm(params, max_norm, total)
    return total


def count_zeros(
    params: Iterable[torch.Tensor], pctx: ParallelContext, sharded_group: str | None = None
) -> int:
    """Number of exactly-zero gradient entries over the whole model (each weight counted once)."""
    counts = []
    for grads in split_grads_for_norm(list(params), pctx):
        total = torch.zeros(1, dtype=torch.float64, device=pctx.device)
        for g in grads:
            total += (g.numel() - torch.count_nonzero(g)).to(pctx.device)
        counts.append(total)
    return int(reduce_model_statistic(*counts, pctx, sharded_group).item())


def unscale_and_check_overflow(
    grads: list[torch.Tensor],
    inv_scale: torch.Tensor,
    pctx: ParallelContext,
    sharded_group: str | None = None,
) -> bool:
    """Multiply `grads` by `inv_scale` in place; True if any rank of the model (and of
    `sharded_group`, and, with experts split over ranks, of the expert groups) saw an inf or
    nan, so that every rank skips the same step."""
    device = grads[0].device if grads else pctx.device
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        for group in _by_device_dtype(grads).values():
            # The fused kernel does both in one pass and exists on CPU and CUDA.
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, found_inf, inv_scale.to(device=group[0].device, dtype=torch.float32)
            )
    found_inf = found_inf.to(pctx.device)
    if _has_expert_layout(pctx) and dist.is_initialized():
        # Expert gradients live on other ranks than the dense ones: ask everybody.
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    else:
        for name in _stat_groups(pctx, sharded_group):
            pctx.all_reduce(found_inf, name, op=dist.ReduceOp.MAX)
    return bool(found_inf.item() > 0)


def get_params_norm(
    model_chunks: Iterable[torch.nn.Module], pctx: ParallelContext, sharded_group: str | None = None
) -> float:
    """L2 norm of every parameter of the model (--log-params-norm), each counted once like the
    gradient norm; parameters sharded over `sharded_group` (FSDP) contribute their local shard."""
    dense, expert = [], []
    seen: set[int] = set()
    for chunk in model_chunks:
        for param in chunk.parameters():
            if id(param) in seen or not counts_in_norm(param, pctx):
                continue
            seen.add(id(param))
            local = param.to_local() if hasattr(param, "to_local") else param
            (expert if is_expert(param) else dense).append(local.detach())
    return get_grad_norm(dense, pctx, 2.0, sharded_group=sharded_group, expert_grads=expert)
