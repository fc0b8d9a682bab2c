"""Pipeline bubble on Gloo: measured idle time per stage against the theory.

Each pipeline stage (or virtual stage) is a small residual MLP plus a fixed compute load: a
sleep (a stand-in for an accelerator, so that stages on a small CPU do not compete for cores)
or real matmuls. Forward costs `--forward-ms`, backward twice that, divided over the virtual
stages so that every rank does the same work whatever v. For every (p, m, v) it runs a few
iterations of `forward_backward` and reports per rank

    bubble = (iteration time - compute time) / compute time

(the idle time, waiting in receives or for the slowest stage at the end, relative to the useful
work), next to the textbook value (p - 1) / m for 1F1B and (p - 1) / (v * m) interleaved.

    python benchmarks/bench_pipeline_bubble.py [--load sleep|matmul] [--configs 2:4:1,4:8:2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.parallel.schedules import ScheduleConfig, ScheduleTimes, forward_backward

SEQ, MICRO_BATCH, HIDDEN = 8, 2, 64


class _Load(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time."""

    @staticmethod
    def forward(ctx, x, forward_load, backward_load):
        ctx.backward_load = backward_load
        forward_load()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.backward_load()
        return grad, None, None


def make_load(kind: str, seconds: float):
    if kind == "sleep":
        return lambda: time.sleep(seconds)
    a = torch.randn(128, 128)
    began, reps = time.perf_counter(), 20
    for _ in range(reps):
        torch.mm(a, a)
    count = max(1, round(seconds / ((time.perf_counter() - began) / reps)))

    def matmuls():
        for _ in range(count):
            torch.mm(a, a)

    return matmuls


class LoadStage(PipelineStage):
    """One (virtual) pipeline stage: h + W h, then the fixed load."""

    def __init__(self, forward_load, backward_load, pre_process: bool, post_process: bool):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.forward_load, self.backward_load = forward_load, backward_load
        self.pre_process, self.post_process = pre_process, post_process

    def forward(self, x):
        h = x if self.pre_process else self.stage_input()
        return _Load.apply(h + self.linear(h), self.forward_load, self.backward_load)


def forward_step(data_iterator, chunk):
    output = chunk(next(data_iterator))

    def loss_fn(out):
        return out.float().pow(2).sum(), torch.tensor(float(out.numel())), {}

    return output, loss_fn


def _worker(rank, world_size, configs, args, result_path):
    pp = world_size
    pctx = ParallelContext.from_sizes(pp=pp)
    rows = []
    for _, m, v in configs:
        forward_s = args["forward_ms"] / 1000 / v
        chunks = [
            LoadStage(
                make_load(args["load"], forward_s),
                make_load(args["load"], 2 * forward_s),
                pre_process=pctx.pp_rank == 0 and k == 0,
                post_process=pctx.pp_rank == pp - 1 and k == v - 1,
            )
            for k in range(v)
        ]
        config = ScheduleConfig(SEQ, MICRO_BATCH, HIDDEN)
        times = ScheduleTimes()
        data = [torch.randn(SEQ, MICRO_BATCH, HIDDEN) for _ in range(m)]
        total = 0.0
        for iteration in range(args["warmup"] + args["iters"]):
            if iteration == args["warmup"]:
                times = ScheduleTimes()
                total = 0.0
            dist.barrier()
            began = time.perf_counter()
            forward_backward(forward_step, iter(data), chunks, m, pctx, config, observer=times)
            dist.barrier()
            total += time.perf_counter() - began
        compute, waited = times.compute_s, times.recv_wait_s
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (total, compute, waited))
        rows.append({"p": pp, "m": m, "v": v, "ranks": per_rank})
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="2:4:1,2:8:1,2:4:2,2:8:2,4:8:1,4:16:1,4:8:2,4:16:2",
                        help="comma-separated p:m:v (pipeline size, micro-batches, virtual stages)")  # fmt: skip
    parser.add_argument("--load", choices=["sleep", "matmul"], default="sleep")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward time per stage")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    by_size: dict[int, list] = {}
    for config in configs:
        by_size.setdefault(config[0], []).append(config)

    rows = []
    for pp, group in sorted(by_size.items()):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            run_distributed(_worker, pp, group, vars(args), path)
            with open(path) as f:
                rows += json.load(f)

    print(f"load: {args.load}, forward {args.forward_ms} ms + backward {2 * args.forward_ms} ms "
          f"per stage and micro-batch, {args.iters} iterations\n")  # fmt: skip
    print("| p | m | v | schedule | theory (p-1)/(v*m) | measured bubble, mean of stages "
          "| min .. max | recv wait / iteration time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        p, m, v = row["p"], row["m"], row["v"]
        bubbles = [(total - compute) / compute for total, compute, _ in row["ranks"]]
        waits = [waited / total for total, _, waited in row["ranks"]]
        print(
            f"| {p} | {m} | {v} | {'interleaved' if v > 1 else '1F1B'} | {(p - 1) / (v * m):.3f} "
            f"| {sum(bubbles) / len(bubbles):.3f} | {min(bubbles):.3f} .. {max(bubbles):.3f} "
            f"| {sum(waits) / len(waits):.3f} |"
        )


if __name__ == "__main__":
    main()
