"""Forward-backward schedules: the one entry point the training loop calls, whatever the
pipeline size.

A `forward_step(data_iterator, model_chunk)` returns `(output, loss_fn)`; on the last pipeline
stage `loss_fn(output)` returns `(loss_sum, num_tokens, report)`: the summed masked per-token loss
of the micro-batch, its token count, and a dict of detached values to log.
The schedule normalises the loss (by the token count unless `per_token_loss`, and by the number
of micro-batches), multiplies by the loss scale, and runs backward. Model chunks are
`PipelineStage`s (parallel/pipeline_stage.py); a `ScheduleObserver` sees the steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gigatron.config.parallel import check_pipeline_schedule
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline import (
    ACTIVATION,
    GRADIENT,
    PipelineCommunicator,
    StageShapes,
    backward_from_output,
    deallocate_output,
    pipeline_tensor_shape,
)
from gigatron.parallel.pipeline_stage import PipelineStage, no_sync, pipeline_stage

ForwardStep = Callable[[Iterator, nn.Module], tuple[torch.Tensor, Callable]]


@dataclass
class ScheduleConfig:
    """What the schedules need to know besides the model and the data."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    pipeline_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    per_token_loss: bool = False
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Interleaved schedule: micro-batches run on one virtual stage before moving to the next
    # (--microbatch-group-size-per-virtual-pipeline-stage); None = the pipeline size.
    microbatch_group_size: int | None = None
    # Models that pass several tensors between stages (T5): stage_shapes(pp_rank) gives the
    # shapes of what that stage sends forward (a list); stages then receive lists, and
    # `chunk.set_input_tensor` gets a list. None: one hidden-state tensor of
    # [seq(/cp)(/tp with SP), micro-batch, hidden] everywhere.
    stage_shapes: StageShapes | None = None
    # "1f1b" (interleaved with virtual stages), "zb-h1" or "dualpipev" (--pipeline-schedule).
    pipeline_schedule: str = "1f1b"
    # Post each receive one step early, so it overlaps compute (--no-overlap-p2p-communication).
    overlap_p2p_comm: bool = True


class ScheduleObserver:
    """Hooks into a forward-backward pass (tracing, timing); the base ignores everything."""

    def on_step(self, kind: str, chunk: int, microbatch: int) -> None:
        """Before each step, in execution order: "F" (forward) or "B" (backward) of model chunk
        `chunk` (its index on this rank) on `microbatch`."""

    def on_pass_end(self, compute_s: float, recv_wait_s: float) -> None:
        """After a pipelined pass: seconds spent in forward and backward compute, and waiting
        for pipeline receives."""

    def on_compute(self, kind: str, chunk: int, microbatch: int, began: float, ended: float):
        """After each step's compute in a pipelined pass: its `time.perf_counter()` interval
        (receives and sends excluded)."""


class ScheduleTimes(ScheduleObserver):
    """Compute and receive-wait seconds summed over pipelined passes (benchmarks)."""

    def __init__(self) -> None:
        self.compute_s = 0.0
        self.recv_wait_s = 0.0

    def on_pass_end(self, compute_s: float, recv_wait_s: float) -> None:
        self.compute_s += compute_s
        self.recv_wait_s += recv_wait_s


def compute_loss(
    output: torch.Tensor,
    loss_fn: Callable,
    num_microbatches: int,
    config: ScheduleConfig,
    forward_only: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Normalised, scaled loss to call backward on, and the report of this micro-batch."""
    loss_sum, num_tokens, report = loss_fn(output)
    report = dict(report)
    if config.per_token_loss:
        loss = loss_sum
    else:
        loss = loss_sum / torch.clamp(torch.as_tensor(num_tokens, dtype=loss_sum.dtype), min=1)
        loss = loss / num_microbatches
    if not forward_only and config.grad_scale_func is not None:
        loss = config.grad_scale_func(loss)
    return loss, report


def forward_backward_no_pipelining(
    forward_step: ForwardStep,
    data_iterator: Iterator,
    model_chunks: list[nn.Module],
    num_microbatches: int,
    config: ScheduleConfig,
    forward_only: bool = False,
    observer: ScheduleObserver | None = None,
) -> list[dict[str, Any]]:
    """Gradient accumulation over micro-batches; gradient reduction only after the last one."""
    assert len(model_chunks) == 1, "without pipeline parallelism there is exactly one model chunk"
    (model,) = model_chunks
    reports = []
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        context = contextlib.nullcontext() if last or forward_only else no_sync(model)
        with context:
            if observer is not None:
                observer.on_step("F", 0, index)
            output, loss_fn = forward_step(data_iterator, model)
            loss, report = compute_loss(output, loss_fn, num_microbatches, config, forward_only)
            if not forward_only:
                if observer is not None:
                    observer.on_step("B", 0, index)
                loss.backward()
        reports.append(report)
    return reports


# ---- pipeline schedules ---------------------------------------------------------------------
#
# A schedule is a per-rank list of steps ("F" | "B", chunk, micro-batch), generated by the pure
# function `pipeline_schedule_order`; one executor runs any such list. The order is Megatron's:
# 1F1B: warm-up forwards (pp - rank - 1), then alternate one forward and one backward, then the
#   remaining backwards; at most pp - rank micro-batches are in flight on a rank.
# Interleaved 1F1B: every rank holds `num_chunks` model chunks (virtual stages). Forwards walk the
#   micro-batches in groups of G (default pp): chunk 0 runs the group's micro-batches, then chunk
#   1 the same ones, ...; backwards walk the same table with the chunks reversed. Warm-up is
#   2 * (pp - rank - 1) + (num_chunks - 1) * G forwards (capped at the total).


def forward_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) of every forward, in order: groups of micro-batches, each group run
    on chunk 0, then chunk 1, ... (the last group takes whatever micro-batches are left)."""
    table = []
    for start in range(0, num_microbatches, group_size):
        members = range(start, min(start + group_size, num_microbatches))
        table.extend((chunk, mb) for chunk in range(num_chunks) for mb in members)
    return table


def num_warmup_steps(
    pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1, group_size: int = 0
) -> int:
    """Forwards run before the first backward on this rank."""
    total = num_microbatches * num_chunks
    if num_chunks == 1:
        return min(pp_size - pp_rank - 1, total)
    return min(2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * group_size, total)


def pipeline_schedule_order(
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
    forward_only: bool = False,
) -> list[tuple[str, int, int]]:
    """The steps ("F" | "B", chunk, micro-batch) of one rank, in execution order."""
    group = check_pipeline_schedule(pp_size, num_microbatches, num_chunks, group_size)
    forwards = [
        ("F", chunk, mb) for chunk, mb in forward_table(num_microbatches, num_chunks, group)
    ]
    if forward_only:
        return forwards
    backwards = [("B", num_chunks - 1 - chunk, mb) for _, chunk, mb in forwards]
    warmup = num_warmup_steps(pp_size, pp_rank, num_microbatches, num_chunks, group)
    order = forwards[:warmup]
    for step in range(len(forwards) - warmup):
        order += [forwards[warmup + step], backwards[step]]
    return order + backwards[len(forwards) - warmup :]


def zb_h1_schedule_order(pp_size: int, pp_rank: int, num_microbatches: int) -> list:
    """ZB-H1 (zero bubble, Qi et al. 2023): 1F1B's forwards and input-gradient backwards ("B")
    in 1F1B's order, each weight-gradient pass ("W") run `pp_rank` micro-batches after its B
    (the later stages, idle at the end of 1F1B, finish their W passes there). Rank r holds
    pp - r activations in flight plus r pending W passes: 1F1B's peak memory (pp) on every
    rank, while the first gradient reaches stage 0 sooner (B passes exclude the weights)."""
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    delay = min(pp_rank, m)
    order: list[tuple[str, int, int]] = [("F", 0, mb) for mb in range(warmup)]
    weights_done = 0
    for backward in range(m):
        if warmup + backward < m:
            order.append(("F", 0, warmup + backward))
        order.append(("B", 0, backward))
        if backward + 1 - weights_done > delay:
            order.append(("W", 0, weights_done))
            weights_done += 1
    return order + [("W", 0, mb) for mb in range(weights_done, m)]


class _OrderBuilder:
    """Appends the steps of a two-chunk schedule; each chunk takes its micro-batches in order,
    and split backwards queue their weight-gradient steps (first in, first out)."""

    def __init__(self) -> None:
        self.order: list[tuple[str, int, int]] = []
        self.next = {"F": [0, 0], "B": [0, 0]}
        self.pending: list[tuple[int, int]] = []

    def step(self, kind: str, chunk: int, split: bool = False) -> None:
        microbatch = self.next[kind][chunk]
        self.next[kind][chunk] += 1
        self.order.append((kind, chunk, microbatch))
        if split:
            self.pending.append((chunk, microbatch))

    def weights(self) -> None:
        chunk, microbatch = self.pending.pop(0)
        self.order.append(("W", chunk, microbatch))


def dualpipev_schedule_order(pp_size: int, pp_rank: int, num_microbatches: int) -> list:
    """DualPipeV (DeepSeek's DualPipe cut in half): two chunks per rank in a V (chunk 0 runs
    stage r, chunk 1 stage 2 pp - 1 - r; the loss is on rank 0's chunk 1). Each rank warms up
    with chunk 0's forwards, runs pairs of one chunk's forward and the other's backward, and fills
    the tail with weight-gradient steps ("W") of split backwards, as DualPipeV's eight phases."""
    p, r, m = pp_size, pp_rank, num_microbatches
    if m < 2 * p:
        raise GigatronError(
            f"--pipeline-schedule dualpipev: {m} micro-batches per iteration, it needs at least "
            f"2 x the pipeline size = {2 * p}; raise --global-batch-size"
        )
    build = _OrderBuilder()
    for _ in range(2 * (p - r - 1)):  # 1: chunk 0 warm-up
        build.step("F", 0)
    for _ in range(r + 1):  # 2: forwards of both chunks
        build.step("F", 0)
        build.step("F", 1)
    for _ in range(p - r - 1):  # 3: chunk 1 backward (its W at once: the whole backward)
        build.step("B", 1)
        build.step("F", 1)
    for _ in range(m - 2 * p + r + 1):  # 4: the steady state, F0 B1 F1 B0
        for kind, chunk in (("F", 0), ("B", 1), ("F", 1), ("B", 0)):
            build.step(kind, chunk)
    for _ in range(p - r - 1):  # 5: B1 F1 B0
        for kind, chunk in (("B", 1), ("F", 1), ("B", 0)):
            build.step(kind, chunk)
    half = (r + 1) // 2
    for index in range(r + 1):  # 6: backwards of both chunks, the second half split
        build.step("B", 1, split=index > half or (index == half and r % 2 == 1))
        build.step("B", 0, split=index >= half)
    for _ in range(p - r - 1):  # 7: weight gradients fill the wait for chunk 0's gradients
        build.weights()
        build.step("B", 0, split=True)
    while build.pending:  # 8: the remaining weight gradients
        build.weights()
    return build.order


def dualpipev_forward_order(num_microbatches: int) -> list[tuple[str, int, int]]:
    """Forward only (evaluation) with the V placement: chunk 0's forwards, then chunk 1's."""
    return [("F", chunk, mb) for chunk in (0, 1) for mb in range(num_microbatches)]


class _SharedMicrobatches:
    """One data iterator shared by several chunks: chunk k's i-th `next()` returns micro-batch
    i, fetched once from the underlying iterator and dropped when every chunk has read it."""

    def __init__(self, iterator: Iterator, num_chunks: int) -> None:
        self.iterator = iterator
        self.num_chunks = num_chunks
        self.fetched: dict[int, Any] = {}
        self.readers: dict[int, int] = {}
        self.next_fetch = 0
        self.position = [0] * num_chunks

    def view(self, chunk: int) -> Iterator:
        while True:
            index = self.position[chunk]
            self.position[chunk] += 1
            while self.next_fetch <= index:
                self.fetched[self.next_fetch] = next(self.iterator)
                self.next_fetch += 1
            item = self.fetched[index]
            self.readers[index] = self.readers.get(index, 0) + 1
            if self.readers[index] == self.num_chunks:
                del self.fetched[index], self.readers[index]
            yield item


def _chunk_iterators(data_iterator: Any, num_chunks: int) -> list[Any]:
    """One data iterator per chunk: a list is used as given; one iterator is shared."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(
                f"{len(data_iterator)} data iterators for {num_chunks} model chunks; give one per "
                "chunk or a single shared one"
            )
        return list(data_iterator)
    if data_iterator is None or num_chunks == 1:
        return [data_iterator] * num_chunks
    shared = _SharedMicrobatches(data_iterator, num_chunks)
    return [shared.view(chunk) for chunk in range(num_chunks)]


def _received_grads(input_tensor: torch.Tensor | list[torch.Tensor]):
    """The gradients of what a stage received, in the message's form (a chunk that ignored an
    input gives it a zero gradient)."""
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in _as_list(input_tensor)]
    return grads if isinstance(input_tensor, list) else grads[0]


def _as_list(tensors: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


class _PipelinePass:
    """One pipelined forward-backward pass on this rank: runs the steps of
    `pipeline_schedule_order`, sends and receives through a `PipelineCommunicator`, and keeps
    each micro-batch's input and output until its backward."""

    def __init__(
        self,
        forward_step: ForwardStep,
        data_iterator: Iterator | list[Iterator] | None,
        model_chunks: list[nn.Module],
        num_microbatches: int,
        pctx: ParallelContext,
        config: ScheduleConfig,
        forward_only: bool,
    ) -> None:
        self.forward_step, self.chunks = forward_step, model_chunks
        self.stages = [pipeline_stage(chunk) for chunk in model_chunks]
        self.num_microbatches = num_microbatches
        self.config, self.forward_only = config, forward_only
        self.pp_size, self.pp_rank = pctx.pp_size, pctx.pp_rank
        self.iterators = _chunk_iterators(data_iterator, len(model_chunks))
        shape = pipeline_tensor_shape(
            config.seq_length,
            config.micro_batch_size,
            config.hidden_size,
            pctx.tp_size,
            pctx.cp_size,
            config.sequence_parallel,
        )
        # DualPipeV: two chunks in a V, the last rank hands chunk 0's output to chunk 1 locally.
        self.v_shape = config.pipeline_schedule == "dualpipev"
        self.comm = PipelineCommunicator(
            pctx, shape, config.pipeline_dtype, num_microbatches, len(model_chunks),
            config.stage_shapes, self.v_shape,
        )  # fmt: skip
        self.local: dict[tuple[int, int, int], Any] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor | list[torch.Tensor] | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.reports: list[dict[str, Any]] = []
        self.compute_s = 0.0
        # ZB-H1, DualPipeV: the backwards whose weight gradients run in a later W step.
        self.split: set[tuple[int, int]] = set()
        self.pending_weights: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.observer: ScheduleObserver | None = None

    def is_first_stage(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def is_last_stage(self, chunk: int) -> bool:
        if self.v_shape:
            return self.pp_rank == 0 and chunk == 1
        return self.pp_rank == self.pp_size - 1 and chunk == len(self.chunks) - 1

    def is_local(self, kind: int, chunk: int) -> bool:
        """Whether (kind, chunk)'s incoming message is a hand-over on this rank (DualPipeV's
        turn at the last rank: chunk 0's output is chunk 1's input)."""
        if not self.v_shape or self.pp_rank != self.pp_size - 1:
            return False
        return chunk == (1 if kind == ACTIVATION else 0)

    def needed_recv(self, step: tuple[str, int, int]) -> int | None:
        """What a step receives before it runs: an activation, a gradient, or nothing."""
        kind, chunk, _ = step
        if kind == "F":
            needed = None if self.is_first_stage(chunk) else ACTIVATION
        elif kind == "W":
            return None
        else:
            needed = None if self.is_last_stage(chunk) else GRADIENT
        return None if needed is None or self.is_local(needed, chunk) else needed

    def receive(self, kind: int, chunk: int, mb: int) -> Any:
        """The message (kind, chunk, mb): from the peer stage, or handed over on this rank."""
        if self.is_local(kind, chunk):
            return self.local.pop((kind, chunk, mb))
        return self.comm.recv(kind, chunk, mb)

    def deliver(self, kind: int, chunk: int, mb: int, tensor: Any, then_recv, free=None) -> None:
        """Send (kind, chunk, mb)'s result on, or hand it to this rank's other chunk."""
        other = 1 - chunk
        if self.is_local(kind, other):
            # What a receive would give: a tensor of its own outside this chunk's graph.
            self.local[(kind, other, mb)] = tensor.detach().clone()
            deallocate_output(free)
            if then_recv is not None:
                self.comm.post_recv(*then_recv)
            return
        self.comm.send(kind, chunk, mb, tensor, free_after=free, then_recv=then_recv)

    def prefetch_plan(self, order: list[tuple[str, int, int]]) -> list[tuple[int, int, int] | None]:
        """The receive each step starts for a later one (the next step that needs a receive), so
        it overlaps this step's compute; it goes out together with this step's send, if any."""
        plan: list[tuple[int, int, int] | None] = [None] * len(order)
        if not self.config.overlap_p2p_comm:
            return plan  # each receive is posted by the step that needs it
        upcoming = None
        for index in range(len(order) - 1, -1, -1):
            plan[index] = upcoming
            kind_needed = self.needed_recv(order[index])
            if kind_needed is not None:
                upcoming = (kind_needed, order[index][1], order[index][2])
        return plan

    def run(self, order: list[tuple[str, int, int]], observer: ScheduleObserver | None):
        """Every step of `order`; returns the last stage's reports."""
        next_recv = self.prefetch_plan(order)
        self.observer = observer
        self.split = {(chunk, mb) for kind, chunk, mb in order if kind == "W"}
        for index, step in enumerate(order):
            kind, chunk_id, mb = step
            if observer is not None:
                observer.on_step(kind, chunk_id, mb)
            if kind == "F":
                self.forward(chunk_id, mb, next_recv[index])
            elif kind == "W":
                self.weight_gradients(chunk_id, mb)
            else:
                self.backward(chunk_id, mb, next_recv[index])
            if next_recv[index] is not None:
                self.comm.post_recv(*next_recv[index])  # a no-op when the send started it
        self.comm.finish()
        if observer is not None:
            observer.on_pass_end(self.compute_s, self.comm.recv_wait_s)
        return self.reports

    def forward(self, chunk_id: int, mb: int, then_recv: tuple[int, int, int] | None) -> None:
        input_tensor = None
        if not self.is_first_stage(chunk_id):
            input_tensor = self.receive(ACTIVATION, chunk_id, mb)
            if not self.forward_only:
                for received in _as_list(input_tensor):
                    received.requires_grad_(True)
            self.stages[chunk_id].set_input_tensor(input_tensor)
        began = time.perf_counter()
        output, loss_fn = self.forward_step(self.iterators[chunk_id], self.chunks[chunk_id])
        last_stage = self.is_last_stage(chunk_id)
        if last_stage:
            output, report = compute_loss(
                output, loss_fn, self.num_microbatches, self.config, self.forward_only
            )
            self.reports.append(report)
        self.computed("F", chunk_id, mb, began)
        if not last_stage:
            self.deliver(ACTIVATION, chunk_id, mb, output, then_recv, free=output)
        if not self.forward_only:
            self.inputs[(chunk_id, mb)] = input_tensor
            self.outputs[(chunk_id, mb)] = output

    def backward(self, chunk_id: int, mb: int, then_recv: tuple[int, int, int] | None) -> None:
        grad_output = None
        if not self.is_last_stage(chunk_id):
            grad_output = self.receive(GRADIENT, chunk_id, mb)
            self.comm.wait_send(ACTIVATION, chunk_id, mb)
        input_tensor = self.inputs.pop((chunk_id, mb))
        output = self.outputs.pop((chunk_id, mb))
        began = time.perf_counter()
        # The last stage's loss turns its saved logits into the gradient in place (one backward
        # only): its B step is the whole backward and its W step has nothing left to do.
        if (chunk_id, mb) in self.split and not self.is_last_stage(chunk_id):
            # ZB-H1's B: the input's gradient only; the weights' wait for the W step.
            if input_tensor is not None:
                received = tuple(_as_list(input_tensor))
                backward_from_output(output, grad_output, inputs=received, keep_graph=True)
            self.pending_weights[(chunk_id, mb)] = (output, grad_output)
        else:
            with self.grad_sync(chunk_id, mb):
                backward_from_output(output, grad_output)
        self.computed("B", chunk_id, mb, began)
        del output, grad_output
        if input_tensor is not None:
            grad_input = _received_grads(input_tensor)
            self.deliver(GRADIENT, chunk_id, mb, grad_input, then_recv)

    def grad_sync(self, chunk_id: int, mb: int) -> contextlib.AbstractContextManager:
        """Gradient reduction (DDP) runs only with each chunk's last micro-batch."""
        last = mb == self.num_microbatches - 1
        return contextlib.nullcontext() if last else no_sync(self.chunks[chunk_id])

    def weight_gradients(self, chunk_id: int, mb: int) -> None:
        """ZB-H1's W: the weights' gradients of a micro-batch whose B step ran (graph kept)."""
        if (chunk_id, mb) not in self.pending_weights:
            return  # the last stage's B step did the whole backward
        output, grad_output = self.pending_weights.pop((chunk_id, mb))
        weights = tuple(p for p in self.chunks[chunk_id].parameters() if p.requires_grad)
        began = time.perf_counter()
        with self.grad_sync(chunk_id, mb):
            backward_from_output(output, grad_output, inputs=weights)
        self.computed("W", chunk_id, mb, began)

    def computed(self, kind: str, chunk_id: int, mb: int, began: float) -> None:
        """Account a step's compute interval (it started at `began`)."""
        ended = time.perf_counter()
        self.compute_s += ended - began
        if self.observer is not None:
            self.observer.on_compute(kind, chunk_id, mb, began, ended)


def set_aux_loss_scale(
    stages: list[PipelineStage], num_microbatches: int, config: ScheduleConfig
) -> None:
    """Tell every auxiliary-loss module of the stages (`aux_loss_modules()`: MoE routers) the
    gradient such a loss gets in backward: what the main loss of a micro-batch is multiplied by
    (the loss scale, divided by the number of micro-batches unless the loss is per token)."""
    modules = [module for stage in stages for module in stage.aux_loss_modules()]
    if not modules:
        return
    scale = torch.ones(1)
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    if not config.per_token_loss:
        scale = scale / num_microbatches
    for module in modules:
        module.set_aux_loss_scale(scale)


def forward_backward(
    forward_step: ForwardStep,
    data_iterator: Iterator | list[Iterator],
    model_chunks: list[nn.Module],
    num_microbatches: int,
    pctx: ParallelContext,
    config: ScheduleConfig,
    forward_only: bool = False,
    observer: ScheduleObserver | None = None,
) -> list[dict[str, Any]]:
    """Run one iteration's forward (and backward) passes; returns one report per micro-batch on
    the last pipeline stage (an empty list elsewhere). Every chunk is a `PipelineStage` (or
    wraps one); `observer` sees the steps and, pipelined, the pass's timings."""
    stages = [pipeline_stage(chunk) for chunk in model_chunks]
    if not forward_only:
        set_aux_loss_scale(stages, num_microbatches, config)
    if pctx.pp_size == 1:
        if isinstance(data_iterator, (list, tuple)):
            (data_iterator,) = data_iterator
        return forward_backward_no_pipelining(
            forward_step, data_iterator, model_chunks, num_microbatches, config, forward_only,
            observer,
        )  # fmt: skip
    # 1F1B with one chunk per rank, interleaved 1F1B with several (virtual stages), ZB-H1,
    # DualPipeV (two chunks in a V).
    if config.pipeline_schedule == "dualpipev":
        if len(model_chunks) != 2:
            raise GigatronError(
                "--pipeline-schedule dualpipev: two model chunks per rank; give "
                "--num-virtual-stages-per-pipeline-rank 2"
            )
        order = (
            dualpipev_forward_order(num_microbatches)
            if forward_only
            else dualpipev_schedule_order(pctx.pp_size, pctx.pp_rank, num_microbatches)
        )
    elif config.pipeline_schedule == "zb-h1" and not forward_only:
        if len(model_chunks) > 1:
            raise GigatronError(
                "--pipeline-schedule zb-h1: one model chunk per rank only; drop the virtual "
                "pipeline stages"
            )
        order = zb_h1_schedule_order(pctx.pp_size, pctx.pp_rank, num_microbatches)
    else:
        order = pipeline_schedule_order(
            pctx.pp_size,
            pctx.pp_rank,
            num_microbatches,
            len(model_chunks),
            config.microbatch_group_size,
            forward_only,
        )
    run = _PipelinePass(
        forward_step, data_iterator, model_chunks, num_microbatches, pctx, config, forward_only
    )
    return run.run(order, observer)
