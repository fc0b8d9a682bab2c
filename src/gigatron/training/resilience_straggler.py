"""Straggler detection (`--log-straggler`, `--straggler-minmax-count`): which ranks slow the
others down.

Every log interval each rank contributes, per iteration of the window, its compute time (the
`forward-backward` timer) and its time in the gradient all-reduce (the `all-grads-sync` timer:
a collective waits for its slowest member, so a fast rank's wait grows with a straggler's
compute). One all-gather gives every rank's figures to rank 0, which logs the
`--straggler-minmax-count` slowest and fastest ranks and writes a `straggler` record to
metrics.jsonl. Cost: one small all-gather per log interval.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gigatron.parallel.context import ParallelContext

COMPUTE_TIMER = "forward-backward"
WAIT_TIMER = "all-grads-sync"


def gather_times(
    timers_ms: dict[str, float], iterations: int, pctx: ParallelContext
) -> torch.Tensor:
    """[world, 2]: every rank's (compute, gradient-sync wait) milliseconds per iteration."""
    per = max(iterations, 1)
    mine = torch.tensor(
        [timers_ms.get(COMPUTE_TIMER, 0.0) / per, timers_ms.get(WAIT_TIMER, 0.0) / per],
        dtype=torch.float64,
        device=pctx.device,
    )
    if pctx.world_size == 1 or not dist.is_initialized():
        return mine.view(1, 2).cpu()
    everyone = [torch.empty_like(mine) for _ in range(pctx.world_size)]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).cpu()


def straggler_record(times: torch.Tensor, iteration: int, count: int) -> dict[str, Any]:
    """The metrics.jsonl record of one report: the slowest and fastest `count` ranks by
    compute time, and every rank's figures."""
    compute, wait = times[:, 0], times[:, 1]
    order = torch.argsort(compute, descending=True, stable=True).tolist()
    count = max(1, min(count, len(order)))
    return {
        "type": "straggler",
        "iteration": iteration,
        "slowest_ranks": order[:count],
        "fastest_ranks": order[::-1][:count],
        "compute_ms": [round(v, 3) for v in compute.tolist()],
        "wait_ms": [round(v, 3) for v in wait.tolist()],
        "compute_max_over_min": float(compute.max() / compute.min().clamp_min(1e-9)),
    }


def straggler_line(record: dict[str, Any]) -> str:
    """The log line of a report."""
    compute, wait = record["compute_ms"], record["wait_ms"]

    def ranks(names: list[int]) -> str:
        return ", ".join(f"rank {r} ({compute[r]:.1f} ms compute, {wait[r]:.1f} ms waiting)"
                         for r in names)  # fmt: skip

    return (
        f"stragglers at iteration {record['iteration']}: compute per iteration "
        f"{min(compute):.1f}-{max(compute):.1f} ms over {len(compute)} ranks "
        f"(max/min {record['compute_max_over_min']:.2f}); slowest: "
        f"{ranks(record['slowest_ranks'])}; fastest: {ranks(record['fastest_ranks'])}"
    )


def report_stragglers(
    metrics: Any, timers_ms: dict[str, float], iterations: int, iteration: int,
    pctx: ParallelContext, count: int,
) -> dict[str, Any]:  # fmt: skip
    """Gather, then log and record on the writer rank (collective: every rank calls it)."""
    record = straggler_record(gather_times(timers_ms, iterations, pctx), iteration, count)
    metrics.write(record)
    metrics.message(straggler_line(record))
    return record
