"""Bubble per schedule, measured on Gloo against the theory: 1F1B, interleaved 1F1B (2 chunks),
ZB-H1 and DualPipeV at the same p and m.

Every stage is `gigatron.parallel.bubble.TimedStage`: its forward, input gradient and weight
gradient each sleep a calibrated time (a stand-in for an accelerator's compute, so the p
processes do not compete for the CPU cores), split evenly over a rank's chunks. The executor
reports every step's compute interval (`StageTimeline`); per pass

    bubble = (p x makespan - sum of the ranks' compute) / sum of the ranks' compute

(the shortest of `--passes` passes). The theory is `parallel.bubble.simulate`: the same orders
on the same costs with no communication latency.

    python benchmarks/bench_bubble_schedules.py [--pp 4] [--microbatches 8,16] [--unit-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from gigatron.parallel.bubble import StepCosts, measure_bubble, simulate
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.schedules import (
    dualpipev_schedule_order,
    pipeline_schedule_order,
    zb_h1_schedule_order,
)

# (name, --pipeline-schedule, chunks per rank)
SCHEDULES = [
    ("1F1B", "1f1b", 1),
    ("interleaved 1F1B", "1f1b", 2),
    ("ZB-H1", "zb-h1", 1),
    ("DualPipeV", "dualpipev", 2),
]


def theory(schedule: str, chunks: int, pp: int, m: int, costs: StepCosts) -> float:
    if schedule == "dualpipev":
        orders = [dualpipev_schedule_order(pp, r, m) for r in range(pp)]
    elif schedule == "zb-h1":
        orders = [zb_h1_schedule_order(pp, r, m) for r in range(pp)]
    else:
        orders = [pipeline_schedule_order(pp, r, m, chunks) for r in range(pp)]
    half = StepCosts(
        *(getattr(costs, f) / chunks for f in ("forward", "input_grad", "weight_grad"))
    )
    return simulate(orders, v_shape=schedule == "dualpipev", costs=half).bubble()


def _worker(rank: int, world_size: int, args: dict, path: str) -> None:
    pctx = ParallelContext.from_sizes(pp=world_size)
    unit = args["unit_ms"] / 1000
    costs = StepCosts(unit * args["forward"], unit * args["input_grad"], unit * args["weight_grad"])
    rows = []
    for m in args["microbatches"]:
        for name, schedule, chunks in SCHEDULES:
            report = measure_bubble(pctx, schedule, chunks, m, costs, args["passes"])
            rows.append([name, m, theory(schedule, chunks, world_size, m, costs),
                         report.bubble(), report.makespan])  # fmt: skip
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", default="8,16")
    parser.add_argument("--unit-ms", type=float, default=20.0)
    parser.add_argument("--forward", type=float, default=1.0, help="forward cost, in units")
    parser.add_argument("--input-grad", type=float, default=1.0)
    parser.add_argument("--weight-grad", type=float, default=1.0)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    settings = vars(args) | {"microbatches": [int(m) for m in args.microbatches.split(",")]}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        run_distributed(_worker, args.pp, settings, path)
        with open(path) as f:
            rows = json.load(f)
    print("| p | m | schedule | theory | measured | measured / theory | makespan s |")
    print("|---|---|---|---|---|---|---|")
    for name, m, expected, measured, makespan in rows:
        print(f"| {args.pp} | {m} | {name} | {expected:.3f} | {measured:.3f} | "
              f"{measured / expected:.2f} | {makespan:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
