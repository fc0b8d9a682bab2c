"""Collectives that autograd sees, for tensor, sequence, context and expert parallelism.

Each function is the forward of a `torch.autograd.Function` whose backward is the conjugate
collective (an all-reduce's conjugate is the identity, an all-gather's is a reduce-scatter, ...).
They take the ParallelContext whose tensor-parallel group they talk in, and are the identity when
that group has a single member. Layouts: "tensor-parallel region" tensors are split along the last
dimension (hidden or vocabulary); "sequence-parallel region" tensors are split along dimension 0
(the sequence, in the [seq, batch, hidden] layout).

The expert-parallel ones (at the end) take the name of the group they talk in ("ep",
"expert_tp"): token exchanges along dimension 0 with equal or per-rank sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gigatron.parallel.context import ParallelContext

# torch 2.13 renamed the single-tensor collectives; older versions (>= 2.4) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tp(pctx: ParallelContext) -> tuple[Any, int, int]:
    return pctx.group("tp"), pctx.tp_size, pctx.tp_rank


def _all_reduce(x: torch.Tensor, group: Any, size: int = 0, rank: int = 0) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: Any, size: int, rank: int = 0) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp size {size}")
    return x.chunk(size, dim=0)[rank].contiguous()


def _gather_first(x: torch.Tensor, group: Any, size: int, rank: int = 0) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: Any, size: int, rank: int = 0) -> torch.Tensor:
    # Gloo gained reduce_scatter for tensors in recent torch versions (checked on 2.13: it works);
    # a native reduce-scatter moves 1/size of the data an all-reduce + slice would.
    x = x.contiguous()
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp size {size}")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def _identity(x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
    return x


def _reduce_copy(x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
    return _all_reduce(x.clone(), group)  # the input stays as it was


class _Conjugate(torch.autograd.Function):
    """A collective in forward and its conjugate in backward: `ops` = (forward, backward), each
    `(x, group, size, rank) -> tensor`."""

    @staticmethod
    def forward(ctx, x, ops, group, size, rank):
        ctx.backward_op, ctx.group, ctx.size, ctx.rank = ops[1], group, size, rank
        return ops[0](x, group, size, rank)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group, ctx.size, ctx.rank), None, None, None, None


# (forward, backward) pairs; every function takes (x, group, size, rank).
_COPY = (_identity, _all_reduce)
_REDUCE = (_reduce_copy, _identity)
_SCATTER_LAST = (_split_last, _gather_last)
_GATHER_LAST = (_gather_last, _split_last)
_SCATTER_FIRST = (_split_first, _gather_first)
_GATHER_FIRST = (_gather_first, _reduce_scatter_first)
_GATHER_FIRST_KEEP_SLICE = (_gather_first, _split_first)
_REDUCE_SCATTER_FIRST = (_reduce_scatter_first, _gather_first)


def _on_tp(x: torch.Tensor, pctx: ParallelContext, ops: tuple[Any, Any]) -> torch.Tensor:
    """`ops` (forward, backward) over the tp group; x itself when tp is 1."""
    if pctx.tp_size == 1:
        return x
    return _Conjugate.apply(x, ops, *_tp(pctx))


def copy_to_tp_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over tp (input of a column-parallel layer)."""
    return _on_tp(x, pctx, _COPY)


def reduce_from_tp_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """All-reduce forward over tp, identity backward (output of a row-parallel layer)."""
    return _on_tp(x, pctx, _REDUCE)


def scatter_to_tp_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the gradient is all-gathered."""
    return _on_tp(x, pctx, _SCATTER_LAST)


def gather_from_tp_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """All-gather along the last dimension; the gradient is split."""
    return _on_tp(x, pctx, _GATHER_LAST)


def scatter_to_sequence_parallel_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Keep this rank's slice of dimension 0 (the sequence); the gradient is all-gathered."""
    return _on_tp(x, pctx, _SCATTER_FIRST)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, pctx: ParallelContext, reduce_grads: bool = True
) -> torch.Tensor:
    """All-gather along dimension 0. The backward reduce-scatters the gradient (the gathered
    tensor fed a tensor-parallel computation whose partial gradients must be summed) or, with
    `reduce_grads=False`, just keeps this rank's slice."""
    return _on_tp(x, pctx, _GATHER_FIRST if reduce_grads else _GATHER_FIRST_KEEP_SLICE)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, pctx: ParallelContext
) -> torch.Tensor:
    """Sum over tp and keep this rank's slice of dimension 0; the gradient is all-gathered."""
    return _on_tp(x, pctx, _REDUCE_SCATTER_FIRST)


# ---- context parallelism: the same collectives in the context-parallel group -------------------


def _cp(pctx: ParallelContext) -> tuple[Any, int, int]:
    return pctx.group("cp"), pctx.cp_size, pctx.cp_rank


def _all_to_all(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int):
    # Part j of the scatter dimension goes to rank j; what rank j sends lands at position j of
    # the gather dimension.
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, scatter_dim, gather_dim):
        ctx.group, ctx.size, ctx.dims = group, size, (scatter_dim, gather_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        # The inverse exchange: what was gathered is scattered back.
        return (
            _all_to_all(grad, ctx.group, ctx.size, gather_dim, scatter_dim),
            None,
            None,
            None,
            None,
        )


def gather_from_context_parallel_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """All-gather along dimension 0 over cp (ranks in order); the backward reduce-scatters, since
    every rank's queries contributed to the gradient of every gathered key and value."""
    if pctx.cp_size == 1:
        return x
    return _Conjugate.apply(x, _GATHER_FIRST, *_cp(pctx))


def all_to_all_context_parallel(
    x: torch.Tensor, pctx: ParallelContext, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Split `scatter_dim` into cp parts, send part j to cp rank j, and concatenate what arrives
    along `gather_dim` (rank order). The backward is the inverse exchange."""
    if pctx.cp_size == 1:
        return x
    group, size, _ = _cp(pctx)
    return _AllToAll.apply(x, group, size, scatter_dim, gather_dim)


# ---- expert parallelism: token exchanges along dimension 0 in a named group -------------------
def _group(pctx: ParallelContext, name: str) -> tuple[Any, int, int]:
    return pctx.group(name), pctx.size(name), pctx.rank_in(name)


def gather_along_first_dim(x: torch.Tensor, pctx: ParallelContext, group: str) -> torch.Tensor:
    """All-gather equal-size slices along dim 0 (rank order); the gradient is reduce-scattered
    (each rank's computation on gathered rows sends its partial gradient back to their owner)."""
    if pctx.size(group) == 1:
        return x
    return _Conjugate.apply(x, _GATHER_FIRST, *_group(pctx, group))


def reduce_scatter_along_first_dim(
    x: torch.Tensor, pctx: ParallelContext, group: str
) -> torch.Tensor:
    """Sum over the group and keep this rank's equal slice of dim 0; the gradient is gathered."""
    if pctx.size(group) == 1:
        return x
    return _Conjugate.apply(x, _REDUCE_SCATTER_FIRST, *_group(pctx, group))


def all_gather_tensor(x: torch.Tensor, pctx: ParallelContext, group: str) -> torch.Tensor:
    """[size(group), *x.shape]: every rank's `x` in rank order (no gradient; for counts)."""
    size = pctx.size(group)
    if size == 1:
        return x.unsqueeze(0)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=pctx.group(group))
    return out.view(size, *x.shape)


def _all_to_all_rows(x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int]):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all_rows(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        # The conjugate exchange: every row goes back where it came from.
        return _all_to_all_rows(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(
    x: torch.Tensor,
    pctx: ParallelContext,
    group: str,
    output_splits: list[int],
    input_splits: list[int],
) -> torch.Tensor:
    """Rows [sum(input_splits), ...] -> [sum(output_splits), ...]: the i-th block of
    `input_splits` rows goes to rank i of the group, and block i of the result came from it."""
    if pctx.size(group) == 1:
        return x
    return _AllToAllRows.apply(x, pctx.group(group), list(output_splits), list(input_splits))


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _gather_v(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    # Equal-size collectives on padded blocks: one all-gather instead of one broadcast per rank.
    if max(sizes) == 0:
        return x.new_zeros((0, *x.shape[1:]))
    padded = _gather_first(_pad_rows(x, max(sizes)), group, len(sizes))
    blocks = padded.chunk(len(sizes))
    return torch.cat([block[:size] for block, size in zip(blocks, sizes)])


def _reduce_scatter_v(x: torch.Tensor, group: Any, sizes: list[int], rank: int) -> torch.Tensor:
    rows = max(sizes)
    if rows == 0:
        return x.new_zeros((0, *x.shape[1:]))
    blocks = [_pad_rows(block, rows) for block in x.split(sizes)]
    out = _reduce_scatter_first(torch.cat(blocks), group, len(sizes))
    return out[: sizes[rank]]


class _GatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, rank):
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        return _gather_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_v(grad, ctx.group, ctx.sizes, ctx.rank), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, rank):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_v(x, group, sizes, rank)

    @staticmethod
    def backward(ctx, grad):
        return _gather_v(grad, ctx.group, ctx.sizes), None, None, None


def gather_along_first_dim_v(
    x: torch.Tensor, pctx: ParallelContext, group: str, sizes: list[int]
) -> torch.Tensor:
    """All-gather blocks of `sizes[i]` rows from rank i (in rank order); gradient: reduce-scatter."""
    if pctx.size(group) == 1:
        return x
    return _GatherV.apply(x, pctx.group(group), list(sizes), pctx.rank_in(group))


def reduce_scatter_along_first_dim_v(
    x: torch.Tensor, pctx: ParallelContext, group: str, sizes: list[int]
) -> torch.Tensor:
    """Sum over the group rows laid out as blocks of `sizes[i]` (one per rank) and keep this
    rank's block; gradient: all-gather."""
    if pctx.size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, pctx.group(group), list(sizes), pctx.rank_in(group))
