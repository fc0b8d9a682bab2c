"""The bubble measured on Gloo (parallel/bubble.py `measure_bubble`: stages whose forward, input
gradient and weight gradient each take a calibrated time; the executor's compute intervals per
rank) at p = 4, m = 8 for 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV: each near its zero-latency
theory (never below it), ZB-H1's below 1F1B's and DualPipeV's the smallest.
The margins are a fraction of the theoretical gaps (ZB-H1 0.055 under 1F1B here, measured 0.07
on the loaded 2-core machine); message latency only adds idle time, to every schedule."""

from __future__ import annotations

import pytest
import torch

from gigatron.parallel.bubble import StepCosts, measure_bubble, simulate
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.schedules import (
    dualpipev_schedule_order,
    pipeline_schedule_order,
    zb_h1_schedule_order,
)

pytestmark = pytest.mark.distributed

PP, M = 4, 8
COSTS = StepCosts(0.010, 0.020, 0.020)  # forward, input gradient, weight gradient (seconds)
HALF = StepCosts(0.005, 0.010, 0.010)  # per chunk with two chunks per rank
SCHEDULES = {  # name: (--pipeline-schedule, chunks per rank, each rank's order)
    "1f1b": ("1f1b", 1, lambda r: pipeline_schedule_order(PP, r, M)),
    "interleaved": ("1f1b", 2, lambda r: pipeline_schedule_order(PP, r, M, 2)),
    "zb-h1": ("zb-h1", 1, lambda r: zb_h1_schedule_order(PP, r, M)),
    "dualpipev": ("dualpipev", 2, lambda r: dualpipev_schedule_order(PP, r, M)),
}


def _measure(rank: int, world_size: int, path: str) -> None:
    pctx = ParallelContext.from_sizes(pp=PP)
    measured = {}
    for name, (schedule, chunks, _) in SCHEDULES.items():
        report = measure_bubble(pctx, schedule, chunks, M, COSTS, passes=2)
        measured[name] = [report.makespan, *report.busy]
    if rank == 0:
        torch.save(measured, path)


def test_measured_bubbles_follow_the_theory_and_zb_h1_beats_1f1b(tmp_path):
    run_distributed(_measure, PP, str(tmp_path / "bubbles.pt"))
    measured = torch.load(tmp_path / "bubbles.pt")
    bubble, theory = {}, {}
    for name, (_, chunks, order) in SCHEDULES.items():
        makespan, *busy = measured[name]
        # every rank computed what its steps cost (the sleeps), whatever the schedule
        expected = simulate([order(r) for r in range(PP)], name == "dualpipev",
                            HALF if chunks == 2 else COSTS)  # fmt: skip
        assert busy == pytest.approx(expected.busy, rel=0.15), name
        bubble[name] = (PP * makespan - sum(busy)) / sum(busy)
        theory[name] = expected.bubble()
        assert theory[name] - 0.02 < bubble[name] < 2 * theory[name] + 0.1, name
    assert bubble["zb-h1"] < bubble["1f1b"] - 0.025
    assert bubble["dualpipev"] < bubble["interleaved"] + 0.02
    assert bubble["interleaved"] < bubble["1f1b"] - 0.1
