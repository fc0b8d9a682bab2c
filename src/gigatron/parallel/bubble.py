"""Pipeline bubbles: each rank's idle time in one forward-backward pass, in theory (`simulate`:
every rank's steps run on ideal costs, each as soon as its inputs exist, with no communication
latency) and measured (`StageTimeline`: the wall-clock compute intervals the schedule executor
reports on every rank).

Stages are numbered along the model: with one chunk per rank stage = chunk x pp + rank (the
interleaved round robin); in DualPipeV's V chunk 0 of rank r is stage r and chunk 1 is stage
2 pp - 1 - r. A forward needs the previous stage's forward of its micro-batch; a backward ("B")
the stage's own forward and the next stage's backward; a weight-gradient step ("W") its own B.
Like the executor, a backward is split (input gradient in B, weight gradients in W) when the
order has a W step for it, except on the model's last stage (its loss allows one backward), and
stage 0 has no input gradient to compute.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.parallel.schedules import ScheduleConfig, ScheduleObserver, forward_backward

Step = tuple[str, int, int]


@dataclass(frozen=True)
class StepCosts:
    """Time of one micro-batch's forward, input gradient and weight gradient on one stage."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0


@dataclass
class BubbleReport:
    """One pass: its makespan and each rank's busy (compute) time."""

    makespan: float
    busy: list[float]

    def idle_fractions(self) -> list[float]:
        """Per rank: the share of the pass it spent idle."""
        return [1.0 - busy / self.makespan for busy in self.busy]

    def bubble(self) -> float:
        """Idle time over compute time, summed over ranks (the textbook (p - 1) / m for 1F1B)."""
        return (len(self.busy) * self.makespan - sum(self.busy)) / sum(self.busy)


def stage_of(pp_size: int, rank: int, chunk: int, v_shape: bool) -> int:
    """The model stage that `chunk` of `rank` runs."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp_size - 1 - rank
    return chunk * pp_size + rank


def _dependencies(kind: str, stage: int, mb: int, last: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "W":
        return [("B", stage, mb)]
    return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < last else [])


def _cost(kind: str, stage: int, split: bool, last: int, costs: StepCosts) -> float:
    input_grad = costs.input_grad if stage > 0 else 0.0
    if kind == "F":
        return costs.forward
    if kind == "W":
        return costs.weight_grad if stage < last else 0.0
    return input_grad + (0.0 if split and stage < last else costs.weight_grad)


def simulate(
    orders: list[list[Step]], v_shape: bool = False, costs: StepCosts = StepCosts()
) -> BubbleReport:
    """Run every rank's order (`orders[rank]`) on `costs`; raises on a deadlock."""
    pp = len(orders)
    num_chunks = 1 + max(chunk for order in orders for _, chunk, _ in order)
    last = pp * num_chunks - 1
    done: dict[tuple[str, int, int], float] = {}
    clock, busy, position = [0.0] * pp, [0.0] * pp, [0] * pp
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                kind, chunk, mb = orders[rank][position[rank]]
                stage = stage_of(pp, rank, chunk, v_shape)
                needs = _dependencies(kind, stage, mb, last)
                if not all(need in done for need in needs):
                    break
                split = ("W", chunk, mb) in orders[rank]
                cost = _cost(kind, stage, split, last, costs)
                clock[rank] = max([clock[rank]] + [done[need] for need in needs]) + cost
                busy[rank] += cost
                done[(kind, stage, mb)] = clock[rank]
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the schedule deadlocks: ranks stop at steps {position}")
    return BubbleReport(max(clock), busy)


class StageTimeline(ScheduleObserver):
    """This rank's compute intervals (kind, chunk, micro-batch, start, end) in one or more
    passes, from the executor's wall clock; `busy_s` sums them (the pass's idle time is its
    duration minus that)."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, int, int, float, float]] = []

    def on_compute(self, kind: str, chunk: int, microbatch: int, began: float, ended: float):
        self.intervals.append((kind, chunk, microbatch, began, ended))

    def busy_s(self) -> float:
        return sum(end - start for *_, start, end in self.intervals)


# ---- measuring: stages with a calibrated cost ------------------------------------------------


class _Timed(torch.autograd.Function):
    """Identity whose forward and backward each sleep a fixed time: a calibrated compute cost
    that, unlike real arithmetic, does not compete for the CPU cores of the other stages."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedStage(PipelineStage):
    """A model stage whose forward, input gradient and weight gradient take `costs` seconds: the
    input goes through one timed identity, a weight through another (so a split backward runs
    each alone), and their sum goes on."""

    def __init__(self, hidden_size: int, costs: StepCosts) -> None:
        super().__init__()
        self.costs = costs
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        x = self.stage_input() if self.input_tensor is not None else data
        hidden = _Timed.apply(x, self.costs.forward, self.costs.input_grad)
        return hidden + _Timed.apply(self.weight, 0.0, self.costs.weight_grad)


def measure_bubble(
    pctx: ParallelContext,
    schedule: str,
    num_chunks: int,
    num_microbatches: int,
    costs: StepCosts,
    passes: int = 2,
) -> BubbleReport:
    """Run `passes` forward-backward passes of TimedStage chunks (each costing `costs` split over
    the `num_chunks` chunks of a rank) under `schedule` (a --pipeline-schedule value); every
    pipeline rank gets the pass with the shortest makespan (the one least disturbed by other
    load): its makespan and each rank's measured compute time."""
    chunk_costs = StepCosts(*(value / num_chunks for value in dataclasses.astuple(costs)))
    seq, batch, hidden = 2, 1, 8
    chunks = [TimedStage(hidden, chunk_costs) for _ in range(num_chunks)]
    config = ScheduleConfig(seq, batch, hidden, pipeline_schedule=schedule)
    data = torch.zeros(seq, batch, hidden)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        return chunk(data), lambda out: (out.sum(), torch.tensor(1.0), {})

    best = None
    for _ in range(passes):
        timeline = StageTimeline()
        dist.barrier(group=pctx.group("pp"))
        began = time.perf_counter()
        forward_backward(forward_step, itertools.repeat(None), chunks, num_microbatches, pctx,
                         config, observer=timeline)  # fmt: skip
        mine = torch.tensor([time.perf_counter() - began, timeline.busy_s()], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(pctx.pp_size)]
        dist.all_gather(everyone, mine, group=pctx.group("pp"))
        report = BubbleReport(max(float(t[0]) for t in everyone), [float(t[1]) for t in everyone])
        if best is None or report.makespan < best.makespan:
            best = report
    return best
