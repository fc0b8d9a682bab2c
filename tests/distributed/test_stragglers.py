"""Straggler detection (training/resilience_straggler.py) on 3 Gloo ranks: a rank made slow is
named the slowest, and the others' wait in the gradient all-reduce shows its delay."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.training.resilience_straggler import report_stragglers
from gigatron.training.timers import Timers

pytestmark = pytest.mark.distributed
SLOW_RANK, DELAY_S, ITERATIONS = 1, 0.25, 2


class Recorder:
    """The two MetricsLogger methods a report uses."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.lines: list[str] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def message(self, text: str) -> None:
        self.lines.append(text)


def slow_rank(rank: int, world_size: int, out_dir: str) -> None:
    pctx = ParallelContext.from_sizes()
    timers = Timers()
    for _ in range(ITERATIONS):
        timers("forward-backward").start()
        time.sleep(DELAY_S if rank == SLOW_RANK else 0.01)  # the compute of this rank
        timers("forward-backward").stop()
        timers("all-grads-sync").start()
        dist.all_reduce(torch.ones(4))
        timers("all-grads-sync").stop()
    recorder = Recorder()
    report_stragglers(recorder, timers.elapsed_ms(), ITERATIONS, 7, pctx, 1)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([recorder.records, recorder.lines]))


def test_a_slow_rank_is_named(tmp_path):
    run_distributed(slow_rank, 3, str(tmp_path))
    (record,), (line,) = json.loads((tmp_path / "rank0.json").read_text())
    assert record["type"] == "straggler" and record["iteration"] == 7
    assert record["slowest_ranks"] == [SLOW_RANK] and record["fastest_ranks"] != [SLOW_RANK]
    compute, wait = record["compute_ms"], record["wait_ms"]
    assert compute[SLOW_RANK] >= DELAY_S * 1000 > max(c for r, c in enumerate(compute) if r != 1)
    # the others waited in the all-reduce for most of the slow rank's extra compute
    assert min(w for r, w in enumerate(wait) if r != SLOW_RANK) > 0.6 * (DELAY_S - 0.01) * 1000
    assert wait[SLOW_RANK] < min(w for r, w in enumerate(wait) if r != SLOW_RANK)
    assert line.startswith("stragglers at iteration 7: compute per iteration")
    assert f"slowest: rank {SLOW_RANK} (" in line
    # every rank took part and got the same figures
    assert json.loads((tmp_path / "rank2.json").read_text())[0] == [record]
