"""Where a rank's tensors sit in the full (global) tensors: the resharding half of `torch_dist`.

A parameter on one rank is part of a full tensor whose shape does not depend on the parallel
layout. Along each dimension the local tensor is one or more *segments*, each a contiguous run of
local indices that maps to a contiguous run of global indices:
- a dimension that is not split: one segment, local i -> global i;
- the tensor-parallel dimension (`partition_dim`) with `partition_stride` s: s blocks (or the
  tuple's blocks, e.g. Mamba's in_proj [z; x; B; C; dt]); the rank holds its 1/tp slice of each,
  so one segment per block;
- the experts dimension (dim 0 of `expert_parallel` weights): one segment shifted by ep_rank x
  local experts. Expert weights are split over expert-tensor-parallel ranks, not tp.
A rectangle of the local tensor (a whole parameter, or a box of a distributed-optimizer shard)
becomes one `Piece` per combination of segments: a view of local memory with global offsets.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from gigatron.parallel.context import ParallelContext

Segment = tuple[int, int, int]  # (local start, length, global start)


@dataclass(frozen=True)
class TensorLayout:
    """Global shape and, per dimension, the segments of the local tensor."""

    global_shape: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...]


@dataclass
class Piece:
    """A view of local memory that is the box at `offsets` of the global tensor `key`."""

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def tensor_layout(
    attrs: torch.Tensor, local_shape: tuple[int, ...], pctx: ParallelContext
) -> TensorLayout:
    """The layout of a local tensor of `local_shape` carrying the parameter attributes of
    `attrs` (docs/architecture.md, Model: tensor_model_parallel, partition_dim,
    partition_stride, expert_parallel). Tensors without them are replicated."""
    segments: list[tuple[Segment, ...]] = [((0, n, 0),) for n in local_shape]
    global_shape = list(local_shape)
    experts = bool(getattr(attrs, "expert_parallel", False))
    rank, size = (pctx.etp_rank, pctx.etp_size) if experts else (pctx.tp_rank, pctx.tp_size)
    dim = getattr(attrs, "partition_dim", -1)
    if getattr(attrs, "tensor_model_parallel", False) and dim >= 0 and size > 1:
        local = local_shape[dim]
        stride = getattr(attrs, "partition_stride", 1)
        full_blocks = [local * size // stride] * stride if isinstance(stride, int) else stride
        parts, local_start, global_start = [], 0, 0
        for full in full_blocks:
            length = full // size
            parts.append((local_start, length, global_start + rank * length))
            local_start += length
            global_start += full
        segments[dim] = tuple(parts)
        global_shape[dim] = local * size
    if experts and pctx.ep_size > 1:
        (start, length, first), *rest = segments[0]
        assert not rest, "the experts dimension is not tensor-parallel"
        segments[0] = ((start, length, first + pctx.ep_rank * length),)
        global_shape[0] = local_shape[0] * pctx.ep_size
    return TensorLayout(tuple(global_shape), tuple(segments))


def pieces_of_box(
    key: str,
    view: torch.Tensor,
    box_offsets: tuple[int, ...],
    layout: TensorLayout,
) -> list[Piece]:
    """Pieces of `view`, the local box at `box_offsets` (local indices), in global coordinates."""
    per_dim = []
    for dim, segments in enumerate(layout.segments):
        low, high = box_offsets[dim], box_offsets[dim] + view.shape[dim]
        parts = []
        for local_start, length, global_start in segments:
            lo, hi = max(low, local_start), min(high, local_start + length)
            if lo < hi:
                parts.append((lo - low, hi - lo, global_start + lo - local_start))
        per_dim.append(parts)
    pieces = []
    for combination in itertools.product(*per_dim):
        tensor = view
        for dim, (start, length, _) in enumerate(combination):
            if length != tensor.shape[dim]:
                tensor = tensor.narrow(dim, start, length)
        offsets = tuple(global_start for _, _, global_start in combination)
        pieces.append(Piece(key, tensor, offsets, layout.global_shape))
    return pieces


def flat_range_boxes(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes (offsets, sizes, flat start) that tile the flat index range [start, end) of a
    row-major tensor of `shape`; each box is contiguous in flat order, so it is a view of the
    flat range (how a distributed-optimizer shard becomes rectangles)."""
    if start >= end:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    boxes = []
    if start % inner:  # a partial first row
        row = start // inner
        row_end = min(end, (row + 1) * inner)
        for offsets, sizes, flat in flat_range_boxes(
            shape[1:], start - row * inner, row_end - row * inner
        ):
            boxes.append(((row, *offsets), (1, *sizes), flat + row * inner))
        start = row_end
    full_end = end // inner * inner
    if start < full_end:  # whole rows
        rows = (full_end - start) // inner
        boxes.append(((start // inner, *[0] * (len(shape) - 1)), (rows, *shape[1:]), start))
        start = full_end
    if start < end:  # a partial last row
        row = start // inner
        for offsets, sizes, flat in flat_range_boxes(shape[1:], 0, end - row * inner):
            boxes.append(((row, *offsets), (1, *sizes), flat + row * inner))
    return boxes


def pieces_of_flat_shard(
    key: str,
    flat: torch.Tensor,
    shape: tuple[int, ...],
    start: int,
    layout: TensorLayout,
) -> list[Piece]:
    """Pieces of `flat`, the elements [start, start + len(flat)) of a local tensor of `shape`
    flattened (a distributed-optimizer shard)."""
    pieces = []
    for offsets, sizes, flat_start in flat_range_boxes(shape, start, start + flat.numel()):
        view = flat[flat_start - start : flat_start - start + math.prod(sizes)].view(sizes)
        pieces.extend(pieces_of_box(key, view, offsets, layout))
    return pieces
