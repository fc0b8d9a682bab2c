"""Which rank writes a checkpoint file: one per (tp, pp, ep) position (shared by the optimizers'
`distrib_optim.pt` and the checkpoint formats)."""

from __future__ import annotations

from gigatron.parallel.context import ParallelContext


def writes_checkpoint(pctx: ParallelContext) -> bool:
    """One rank per (tp, pp, ep) position writes: the first of its data x context-parallel
    group with its expert-parallel rank (data- and context-parallel rank 0 when ep = 1)."""
    if pctx.ep_size == 1:
        return pctx.rank_in("dp_cp") == 0
    mine = pctx.grid.expert_coords_of(pctx.rank)["ep"]
    for rank in pctx.group_ranks["dp_cp"]:
        if pctx.grid.expert_coords_of(rank)["ep"] == mine:
            return rank == pctx.rank
    return False
