"""`--overlap-param-gather` with and without `--no-align-param-gather` under the interleaved
pipeline (pp 2 x dp 2, two chunks per rank, distributed optimizer): aligned, the optimizer step
starts every chunk's all-gathers together and the pass only waits for them; not aligned, no
all-gather starts in the step and each chunk's start at its own first forward. Both train bit
for bit like the run whose all-gathers finish inside the step (no overlap)."""

from __future__ import annotations

import pytest
import torch
from test_pipeline import (
    BASE_FLAGS,
    MICROBATCHES,
    ScheduleObserver,
    forward_step,
    iteration_loss,
    microbatches,
    schedule_config,
)

from gigatron.config import parse_config
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import forward_backward

pytestmark = pytest.mark.distributed

ITERATIONS = 3
MODES = {
    "sync": ["--overlap-grad-reduce"],
    "aligned": ["--overlap-grad-reduce", "--overlap-param-gather"],
    "deferred": ["--overlap-grad-reduce", "--overlap-param-gather", "--no-align-param-gather"],
}


def launched(chunk: DistributedDataParallel) -> int:
    return sum(event.kind == "gather_launch" for event in chunk.events)


class LaunchesAtForward(ScheduleObserver):
    """Per chunk: the all-gathers every chunk had started in this pass when its first forward
    began."""

    def __init__(self, chunks: list[DistributedDataParallel]) -> None:
        self.chunks, self.at_first_forward = chunks, {}

    def on_step(self, kind: str, chunk: int, microbatch: int) -> None:
        if kind == "F" and chunk not in self.at_first_forward:
            self.at_first_forward[chunk] = [launched(c) for c in self.chunks]


def train(mode: str) -> tuple[list[float], list[torch.Tensor]]:
    flags = [*BASE_FLAGS, "--pipeline-model-parallel-size", "2",
             "--num-virtual-stages-per-pipeline-rank", "2", "--use-distributed-optimizer",
             "--ddp-bucket-size", "2000", "--lr", "1e-2", *MODES[mode]]  # fmt: skip
    cfg = parse_config(flags, world_size=4)
    pctx = ParallelContext.from_sizes(pp=2)
    chunks = [DistributedDataParallel(c, pctx, cfg.parallel) for c in build_model(cfg, pctx)]
    optimizer = build_optimizer(cfg, chunks, pctx)
    losses = []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        observer = LaunchesAtForward(chunks)
        reports = forward_backward(
            forward_step, iter(microbatches(iteration)), chunks, MICROBATCHES, pctx,
            schedule_config(cfg), observer=observer,
        )  # fmt: skip
        buckets = [len(chunk.buckets) for chunk in chunks]
        if iteration > 0 and mode == "deferred":
            # chunk 0's all-gathers start at its first forward, chunk 1's at its own, later
            assert observer.at_first_forward == {0: [0, 0], 1: [buckets[0], 0]}
            assert [launched(chunk) for chunk in chunks] == buckets
        elif mode == "aligned":  # started in the step: the pass only waits for them
            assert [launched(chunk) for chunk in chunks] == [0, 0]
        finalize_model_grads(chunks, pctx)
        before = [launched(chunk) for chunk in chunks]
        optimizer.step()
        launched_in_step = [launched(chunk) - b for chunk, b in zip(chunks, before)]
        assert launched_in_step == ([0, 0] if mode == "deferred" else buckets), mode
        if pctx.pp_rank == 1:
            losses.append(iteration_loss(reports))
    for chunk in chunks:
        chunk.finish_param_sync()
    assert all(b > 1 for b in buckets), "several buckets per chunk"
    return losses, [p.detach().clone() for chunk in chunks for p in chunk.parameters()]


def _run(rank: int, world_size: int) -> None:
    runs = {mode: train(mode) for mode in MODES}
    for mode in ("aligned", "deferred"):
        assert runs[mode][0] == runs["sync"][0], mode
        for param, expected in zip(runs[mode][1], runs["sync"][1]):
            assert torch.equal(param, expected), mode
    losses = runs["sync"][0]
    assert not losses or losses[-1] < losses[0], "the model learns"


def test_aligned_and_deferred_param_gathers_equal_the_synchronous_run():
    run_distributed(_run, 4)
