"""Sums over calibration samples in one fixed order, however many processes share them.

Floating-point addition is not associative, so the order of a sum is fixed by a binary tree over
the sample indices: the node of an aligned interval [s, s + 2^k) is its left half's sum plus its
right half's, a leaf is one sample's statistics, and the whole [0, n) is its maximal aligned
intervals' nodes added from the left. Under torchrun each process scores one contiguous block of
the samples and computes the nodes of its block's maximal aligned intervals (streaming: at most
log2(n) partial sums held at once); every process gathers all of them and builds the root with the
same additions, in the same order, as one process scoring [0, n): the sums are bit-equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from gigatron.parallel.context import ParallelContext

T = TypeVar("T")
Interval = tuple[int, int]  # (start, size), size a power of two, start a multiple of it


def block(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of the samples process `rank` of `world` scores: contiguous, sizes within 1."""
    return rank * n // world, (rank + 1) * n // world


def maximal_intervals(start: int, stop: int) -> list[Interval]:
    """The aligned power-of-two intervals that tile [start, stop), each as large as it can be."""
    out = []
    while start < stop:
        size = 1
        while start % (2 * size) == 0 and start + 2 * size <= stop:
            size *= 2
        out.append((start, size))
        start += size
    return out


def _node(leaf: Callable[[int], T], interval: Interval, merge: Callable[[T, T], T]) -> T:
    """The tree node of `interval`, its leaves computed in order (a binary counter of partials)."""
    start, size = interval
    stack: list[tuple[int, T]] = []
    for index in range(start, start + size):
        width, value = 1, leaf(index)
        while stack and stack[-1][0] == width:
            width, value = 2 * width, merge(stack.pop()[1], value)
        stack.append((width, value))
    ((_, value),) = stack
    return value


def _combine(nodes: dict[Interval, T], interval: Interval, merge: Callable[[T, T], T]) -> T:
    if interval in nodes:
        return nodes[interval]
    start, size = interval
    half = size // 2
    left = _combine(nodes, (start, half), merge)
    return merge(left, _combine(nodes, (start + half, half), merge))


def block_nodes(
    leaf: Callable[[int], T], start: int, stop: int, merge: Callable[[T, T], T]
) -> dict[Interval, T]:
    """The tree nodes of the largest aligned intervals inside [start, stop)."""
    return {interval: _node(leaf, interval, merge) for interval in maximal_intervals(start, stop)}


def root(nodes: dict[Interval, T], n: int, merge: Callable[[T, T], T]) -> T:
    """The sum of [0, n) from the nodes of blocks that tile it (every process's block_nodes)."""
    roots = [_combine(nodes, interval, merge) for interval in maximal_intervals(0, n)]
    total = roots[0]
    for part in roots[1:]:
        total = merge(total, part)
    return total


def ordered_sum(
    n: int, leaf: Callable[[int], T], merge: Callable[[T, T], T], pctx: ParallelContext
) -> T:
    """merge() of leaf(0), ..., leaf(n - 1) in the tree order, the leaves split over the
    data-parallel processes of `pctx` (each calls leaf() on its block only; the processes of
    one model copy, split over tp x pp, on the same block); the same on every process."""
    nodes = block_nodes(leaf, *block(n, pctx.dp_rank, pctx.dp_size), merge)
    if pctx.dp_size > 1:
        gathered: list[Any] = [None] * pctx.dp_size
        dist.all_gather_object(gathered, nodes, group=pctx.group("dp"))
        nodes = {key: value for part in gathered for key, value in part.items()}
    return root(nodes, n, merge)
