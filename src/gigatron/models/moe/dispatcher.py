"""Token dispatchers: bring each routed token to the rank holding its expert and bring the
experts' outputs back, weighted by the routing probabilities.

Experts are split over the expert-parallel group "ep": rank r holds experts
[r * E / ep, (r + 1) * E / ep). With expert tensor parallelism (etp > 1) each expert's MLP is
also split over "expert_tp", and every rank of that group computes its slice for all tokens its
group received; the partial outputs are summed on the way back.

`dispatch(tokens [T, h], probs [T, E], routing_map [T, E], copies)` returns the expert input
[N, h], sorted by local expert, the token count of each local expert, and a handle for
`combine(expert_output [N, h], handle) -> [T, h]`. `copies` is the number of routed (token,
expert) pairs of the routing map when the routing fixes it (the router's `routed_copies`): the
permutation then has sizes known before the data (what a compiled layer prefers).

- `AllToAllDispatcher` ("alltoall"): tokens are permuted by expert (so they are grouped by
  destination rank), exchanged with one all-to-all over "ep" with the exact per-rank counts
  (exchanged first), all-gathered over "expert_tp" (variable sizes), re-sorted by local expert;
  the way back reverses every step and the probabilities are applied on the token's own rank.
- `AllGatherDispatcher` ("allgather"): every rank gathers all tokens, probabilities and routing
  maps of the group (equal sizes), keeps those routed to its experts, and after the experts
  scatters the weighted outputs back with a reduce-scatter (the sum also adds up etp partials).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gigatron.parallel.collectives import (
    all_gather_tensor,
    all_to_all,
    gather_along_first_dim,
    gather_along_first_dim_v,
    reduce_scatter_along_first_dim,
    reduce_scatter_along_first_dim_v,
)
from gigatron.parallel.context import ParallelContext


# ---- permutation ----------------------------------------------------------------------------
def permute(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    copies: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of the routed tokens grouped by expert (in token order within an expert), their
    probabilities, and the source row of each copy. `copies`: how many pairs `routing_map`
    routes, if known; then a stable sort puts them first (the same order) in static sizes
    instead of `nonzero`'s data-dependent ones."""
    expert_major = routing_map.t()
    if copies is None:
        rows = expert_major.nonzero()[:, 1]
        return tokens.index_select(0, rows), probs.t()[expert_major], rows
    unrouted = (~expert_major).reshape(-1).to(torch.uint8)
    order = torch.argsort(unrouted, stable=True)[:copies]
    rows = order % routing_map.shape[0]
    return tokens.index_select(0, rows), probs.t().reshape(-1)[order], rows


def unpermute(
    expert_output: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """sum over each token's copies of probability x expert output -> [num_tokens, h] (summed in
    the probabilities' precision, returned in the output's dtype)."""
    weighted = expert_output.to(probs.dtype) * probs.unsqueeze(-1)
    out = weighted.new_zeros((num_tokens, expert_output.shape[-1]))
    return out.index_add(0, rows, weighted).to(expert_output.dtype)


def sort_chunks_by_expert(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows in blocks ordered (source, expert) with sizes `counts` [sources, experts] ->
    blocks ordered (expert, source)."""
    sources, experts = counts.shape
    if sources == 1:
        return x
    blocks = x.split(counts.reshape(-1).tolist())
    return torch.cat([blocks[s * experts + e] for e in range(experts) for s in range(sources)])


def sort_chunks_by_source(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Inverse of `sort_chunks_by_expert`."""
    sources, experts = counts.shape
    if sources == 1:
        return x
    blocks = x.split(counts.t().reshape(-1).tolist())
    return torch.cat([blocks[e * sources + s] for s in range(sources) for e in range(experts)])


class _Dispatcher:
    def __init__(self, num_experts: int, pctx: ParallelContext) -> None:
        self.pctx = pctx
        self.num_experts = num_experts
        self.ep_size = pctx.size("ep")
        self.num_local_experts = num_experts // self.ep_size
        self.first_local_expert = pctx.rank_in("ep") * self.num_local_experts


@dataclass
class AllToAllHandle:
    rows: torch.Tensor
    probs: torch.Tensor
    num_tokens: int
    input_splits: list[int]
    output_splits: list[int]
    gather_sizes: list[int]
    chunk_counts: torch.Tensor


class AllToAllDispatcher(_Dispatcher):
    """See the module docstring."""

    def dispatch(
        self, tokens: Tensor, probs: Tensor, routing_map: Tensor, copies: int | None = None
    ) -> tuple[Tensor, Tensor, AllToAllHandle]:
        pctx, ep, local = self.pctx, self.ep_size, self.num_local_experts
        counts = routing_map.sum(dim=0)  # [E]
        permuted, permuted_probs, rows = permute(tokens, probs, routing_map, copies)
        # Tokens for rank r are the contiguous block of its experts (sorted by expert).
        input_splits = counts.view(ep, local).sum(dim=1).tolist()
        all_counts = all_gather_tensor(counts, pctx, "ep")  # [ep, E]
        first = self.first_local_expert
        received = all_counts[:, first : first + local]  # [ep sources, local experts]
        output_splits = received.sum(dim=1).tolist()
        x = all_to_all(permuted, pctx, "ep", output_splits, input_splits)
        gathered = all_gather_tensor(received, pctx, "expert_tp")  # [etp, ep, local]
        gather_sizes = gathered.sum(dim=(1, 2)).tolist()
        x = gather_along_first_dim_v(x, pctx, "expert_tp", gather_sizes)
        chunk_counts = gathered.reshape(-1, local)
        x = sort_chunks_by_expert(x, chunk_counts)
        handle = AllToAllHandle(
            rows,
            permuted_probs,
            tokens.shape[0],
            input_splits,
            output_splits,
            gather_sizes,
            chunk_counts,
        )
        return x, chunk_counts.sum(dim=0), handle

    def combine(self, expert_output: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        pctx = self.pctx
        y = sort_chunks_by_source(expert_output, handle.chunk_counts)
        y = reduce_scatter_along_first_dim_v(y, pctx, "expert_tp", handle.gather_sizes)
        y = all_to_all(y, pctx, "ep", handle.input_splits, handle.output_splits)
        return unpermute(y, handle.probs, handle.rows, handle.num_tokens)


@dataclass
class AllGatherHandle:
    rows: torch.Tensor
    probs: torch.Tensor
    num_tokens: int


class AllGatherDispatcher(_Dispatcher):
    """See the module docstring."""

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_along_first_dim(x, self.pctx, "ep")
        return gather_along_first_dim(x, self.pctx, "expert_tp")

    def dispatch(
        self, tokens: Tensor, probs: Tensor, routing_map: Tensor, copies: int | None = None
    ) -> tuple[Tensor, Tensor, AllGatherHandle]:
        all_tokens = self._gather(tokens)
        all_probs = self._gather(probs)
        with torch.no_grad():
            all_map = self._gather(routing_map.to(torch.uint8)).bool()
        first, local = self.first_local_expert, self.num_local_experts
        local_map = all_map[:, first : first + local]
        # With one expert-parallel rank every gathered pair is local: etp x `copies` of them.
        if copies is not None:
            copies = copies * self.pctx.size("expert_tp") if self.ep_size == 1 else None
        x, permuted_probs, rows = permute(
            all_tokens, all_probs[:, first : first + local], local_map, copies
        )
        handle = AllGatherHandle(rows, permuted_probs, all_tokens.shape[0])
        return x, local_map.sum(dim=0), handle

    def combine(self, expert_output: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        out = unpermute(expert_output, handle.probs, handle.rows, handle.num_tokens)
        out = reduce_scatter_along_first_dim(out, self.pctx, "expert_tp")
        return reduce_scatter_along_first_dim(out, self.pctx, "ep")


def build_dispatcher(kind: str, num_experts: int, pctx: ParallelContext) -> _Dispatcher:
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, pctx)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, pctx)
    raise ValueError(f"unknown token dispatcher {kind!r}")
