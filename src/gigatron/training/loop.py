"""The training loop (Megatron's semantics): iterations of micro-batches through the schedule,
gradient finalisation, optimizer and learning-rate steps, logging, evaluation, checkpoints and
the exit conditions.

`train(run)` and `evaluate(...)` know no model family: the family-specific parts are the
`forward_step`, `loss_names` and `flops_per_iteration` in `run` (from the family's record in
gigatron.families), and everything is built by training/run.py's builders (pretrain.py, tasks/finetune.py).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.errors import GigatronError
from gigatron.models.flops import mfu
from gigatron.optim.clip_grads import get_params_norm
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import ScheduleConfig, forward_backward
from gigatron.training.metrics import MetricsLogger
from gigatron.training.profiling import ManualGC, StepProfiler, empty_unused_memory, memory_scalars
from gigatron.training.resilience import Computed, ResultValidator, replayable, skip_batches
from gigatron.training.resilience_straggler import report_stragglers
from gigatron.training.timers import Timers


@dataclass
class TrainState:
    """Where training stands; saved in and restored from checkpoints (Megatron's names)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    """Iterations whose update was skipped (a loss-scale overflow or a gradient not finite)."""
    floating_point_operations_so_far: float = 0.0


@dataclass
class Run:
    """Everything the loop works on (assembled by pretrain.py and tasks/finetune.py)."""

    cfg: Any
    pctx: ParallelContext
    model: list[nn.Module]
    optimizer: Any
    scheduler: Any
    batch_calculator: Any
    forward_step: Callable[[Iterator | None, nn.Module], Any]
    schedule_config: ScheduleConfig
    metrics: MetricsLogger
    train_iters: int
    vocab_size: int
    # FLOPs of one iteration of the given global batch (the family's formula).
    flops_per_iteration: Callable[[int], float]
    # The family's loss report names; the first is the main loss (train_losses, valid loss).
    loss_names: tuple[str, ...] = ("lm_loss",)
    # Reports of a whole training iteration (e.g. MoE routing), called on every rank after the
    # gradients are final (the family's `iteration_reports`).
    iteration_reports: Callable[[list[nn.Module]], dict[str, torch.Tensor]] | None = None
    train_iterator: Iterator | None = None
    valid_iterator: Iterator | None = None
    test_iterator: Iterator | None = None
    state: TrainState = field(default_factory=TrainState)
    # Returns None, or the line to log instead of "saved checkpoint ..." (an async save).
    save_checkpoint: Callable[[TrainState], str | None] | None = None
    # Called after every iteration (an async save finishes its checkpoint when written).
    after_iteration: Callable[[], None] | None = None
    peak_flops: float | None = None
    timers: Timers = field(default_factory=Timers)
    startup_record: Callable[[], dict[str, Any]] | None = None
    # Validate once more when an exit condition stops the run early (quickstart wants a final
    # validation loss; Megatron's default is to exit at once).
    evaluate_on_early_exit: bool = False
    # --rerun-mode (training/resilience.py); train() builds it when None.
    validator: ResultValidator | None = None


@dataclass
class TrainResult:
    """How a run ended, for callers (quickstart, tests)."""

    iteration: int
    exit_reason: str  # "finished", "exit-interval", "exit-duration", "signal"
    train_losses: dict[int, float] = field(default_factory=dict)
    valid_losses: dict[int, float] = field(default_factory=dict)
    test_loss: float | None = None
    # iteration -> every named loss of that iteration
    train_reports: dict[int, dict[str, float]] = field(default_factory=dict)
    last_saved_iteration: int | None = None


class ExitSignal:
    """Records that SIGTERM arrived (with --exit-signal-handler) so the loop can save and stop
    at the end of the current iteration instead of dying half-way through a step."""

    def __init__(self, enabled: bool, signum: int = signal.SIGTERM) -> None:
        self.enabled = enabled
        self.signum = signum
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> ExitSignal:
        if self.enabled:
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            signal.signal(self.signum, self._previous)


def _any_rank(flag: bool, pctx: ParallelContext) -> bool:
    """True on every rank when `flag` is true on at least one."""
    if not dist.is_initialized() or pctx.world_size == 1:
        return flag
    # On the run's device: NCCL reduces only CUDA tensors.
    value = torch.tensor([1.0 if flag else 0.0], device=pctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def reduce_loss_reports(
    reports: list[dict[str, Any]], pctx: ParallelContext, names: Sequence[str]
) -> dict[str, tuple[float, float]]:
    """name -> (sum, count) of one iteration over all micro-batches, data-parallel ranks and
    pipeline stages (each stage reports its own names, e.g. MoE auxiliary losses; the language
    model loss comes from the last one).

    Every rank calls this with the same `names` (the family's) so the collectives match.
    """
    total = reduce_loss_totals(reports, pctx, names)
    return {name: tuple(total[i].tolist()) for i, name in enumerate(names)}


def reduce_loss_totals(
    reports: list[dict[str, Any]], pctx: ParallelContext, names: Sequence[str]
) -> torch.Tensor:
    """`reduce_loss_reports` as a [names, 2] float64 tensor of (sum, count) rows on the run's
    device: collectives but no host synchronisation."""
    index = {name: i for i, name in enumerate(names)}
    total = torch.zeros(len(names), 2, dtype=torch.float64, device=pctx.device)
    for report in reports:
        for name, value in report.items():
            if name not in index:
                raise RuntimeError(
                    f"loss report {name!r} is not among the family's loss names {list(names)}"
                )
            total[index[name]] += value.detach().to(pctx.device, torch.float64)
    for group in ("dp", "pp"):
        if pctx.size(group) > 1:
            dist.all_reduce(total, group=pctx.group(group))
    return total


def mean_losses(totals: dict[str, tuple[float, float]]) -> dict[str, float]:
    """name -> sum / count for the names that saw at least one token."""
    return {name: s / n for name, (s, n) in totals.items() if n > 0}


@dataclass
class StepResult:
    """What one training iteration gives the loop."""

    losses: dict[str, float]  # name -> mean over the iteration's tokens
    success: bool  # False: the optimizer skipped the step (fp16 overflow)
    grad_norm: float | None
    num_zeros: Any  # zeros in the gradients (--log-num-zeros-in-grad), else None


@dataclass
class DeviceStep:
    """One iteration's numbers still on the device; `read_steps` brings those of many
    iterations to the host in one synchronisation (the loop does it at log intervals)."""

    totals: torch.Tensor  # [loss names, 2]: (sum, count) over the iteration, float64
    success: bool  # False: the optimizer skipped the step (fp16 overflow)
    grad_norm: torch.Tensor | None
    num_zeros: Any


def read_steps(steps: Sequence[DeviceStep], names: Sequence[str]) -> list[StepResult]:
    """The steps' losses and gradient norms as numbers, in one host synchronisation."""
    if not steps:
        return []
    rows = [torch.cat([s.totals.reshape(-1), _norm_cell(s.grad_norm, s.totals)]) for s in steps]
    values = torch.stack(rows).tolist()
    results = []
    for step, row in zip(steps, values):
        totals = {name: (row[2 * i], row[2 * i + 1]) for i, name in enumerate(names)}
        norm = row[-1] if step.grad_norm is not None else None
        results.append(StepResult(mean_losses(totals), step.success, norm, step.num_zeros))
    return results


def _norm_cell(norm: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(1) if norm is None else norm.reshape(1).to(like)


def train_step(run: Run, num_microbatches: int) -> StepResult:
    """One iteration (`step_on_device`), its numbers read and checked at once."""
    (step,) = read_steps([step_on_device(run, num_microbatches)], run.loss_names)
    check_step(run, run.state.iteration + 1, step)
    return step


def check_step(run: Run, iteration: int, step: StepResult) -> None:
    """`check_steps` of one iteration."""
    check_steps(run, [(iteration, step)])


def check_steps(run: Run, steps: Sequence[tuple[int, StepResult]]) -> None:
    """A GigatronError for the first iteration with a non-finite loss (not under fp16: its
    overflows are skipped steps) or gradient norm, unless --no-check-for-nan-in-loss-and-grad.
    Every rank takes the same decision, in one collective for all the steps."""
    if not run.cfg.training.check_for_nan_in_loss_and_grad or not steps:
        return
    problem = _first_non_finite(steps, run.cfg.training.fp16)
    # Only some stages see a loss; every rank must take the same decision.
    if _any_rank(problem is not None, run.pctx):
        iteration, what, value = problem or (steps[-1][0], run.loss_names[0], None)
        raise _non_finite_error(run, iteration, what.replace("_", " "), value)


def _first_non_finite(
    steps: Sequence[tuple[int, StepResult]], fp16: bool
) -> tuple[int, str, float | None] | None:
    for iteration, step in steps:
        bad = [name for name, value in step.losses.items() if not math.isfinite(value)]
        if bad and not fp16:
            return iteration, bad[0], step.losses[bad[0]]
        norm = step.grad_norm
        if step.success and norm is not None and not math.isfinite(norm):
            return iteration, "gradient norm", norm
    return None


def step_on_device(run: Run, num_microbatches: int) -> DeviceStep:
    """One iteration: forward-backward over the micro-batches, gradient sync, result validation
    when it runs every step (training/resilience.py), optimizer step; no host synchronisation
    otherwise (but fp16's overflow check, per-token loss scaling, MoE's token counts and the
    flags that ask for a number: --log-num-zeros-in-grad)."""
    pctx = run.pctx
    totals = _validated_totals(run, num_microbatches)
    level = run.cfg.training.empty_unused_memory_level
    run.timers("optimizer").start()
    success, grad_norm, num_zeros = run.optimizer.step_on_device()
    run.timers("optimizer").stop()
    empty_unused_memory(level, 1, pctx.device)
    return DeviceStep(totals, bool(success), grad_norm, num_zeros)


def _validated_totals(run: Run, num_microbatches: int) -> torch.Tensor:
    """The iteration's reduced loss totals (`reduce_loss_totals`). When the result is validated
    every step (`ResultValidator.per_step`: one host synchronisation), a rejected result is
    re-run from the same state and the re-run's totals (and gradients) are the iteration's."""
    validator = run.validator
    if validator is None or not validator.per_step:
        reports = _compute_gradients(run, num_microbatches)
        return reduce_loss_totals(reports, run.pctx, run.loss_names)

    def computed() -> Computed:
        reports = _compute_gradients(run, num_microbatches)
        totals = reduce_loss_totals(reports, run.pctx, run.loss_names)
        rows = totals.tolist()  # the validator needs the numbers: the step's one read
        losses = mean_losses({name: tuple(rows[i]) for i, name in enumerate(run.loss_names)})
        return Computed(losses, reports, totals)

    validator.begin(run.train_iterator)
    return validator.validate(run.state.iteration + 1, computed(), computed).totals


def _compute_gradients(run: Run, num_microbatches: int) -> list[dict[str, Any]]:
    """Forward-backward over the micro-batches and gradient sync (the part a re-run repeats);
    this rank's loss reports."""
    pctx = run.pctx
    run.optimizer.zero_grad()  # also zeroes the DDP gradient buffers
    run.timers("forward-backward").start()
    reports = forward_backward(
        run.forward_step,
        run.train_iterator,
        run.model,
        num_microbatches,
        pctx,
        run.schedule_config,
    )
    run.timers("forward-backward").stop()
    level = run.cfg.training.empty_unused_memory_level
    empty_unused_memory(level, 2, pctx.device)
    num_tokens = None
    if run.schedule_config.per_token_loss:  # the main loss's tokens in the global batch
        main = run.loss_names[0]
        num_tokens = reduce_loss_reports(reports, pctx, run.loss_names)[main][1]
    run.timers("all-grads-sync").start()  # a collective: waits for the slowest rank
    finalize_model_grads(run.model, pctx, num_tokens)
    run.timers("all-grads-sync").stop()
    if run.iteration_reports is not None:
        reports = [*reports, run.iteration_reports(run.model)]
    return reports


def skipped_step(run: Run) -> DeviceStep:
    """An iteration of --iterations-to-skip: no losses, no update (counted as skipped)."""
    totals = torch.zeros(len(run.loss_names), 2, dtype=torch.float64, device=run.pctx.device)
    return DeviceStep(totals, False, None, None)


def _non_finite_error(run: Run, iteration: int, what: str, value: float | None) -> GigatronError:
    saved = run.cfg.checkpoint.save
    kept = (
        f"the last good checkpoint in {saved} is kept (this state was not saved)"
        if saved
        else "nothing was saved"
    )
    # Here when result validation did not run every step (--rerun-mode disabled): the value
    # was read at a log line, after its iteration's update.
    return GigatronError(
        f"iteration {iteration}: the {what} is {value} (not finite), found with --rerun-mode "
        f"{run.cfg.training.rerun_mode} (no re-run); training stopped and {kept}. Lower --lr, "
        "raise --lr-warmup-iters, set --clip-grad, or try --bf16/--fp16 loss scaling"
    )


@torch.no_grad()
def evaluate(
    run: Run, data_iterator: Iterator, eval_iters: int, num_microbatches: int
) -> dict[str, float]:
    """name -> mean loss over `eval_iters` batches (model in eval mode: no dropout)."""
    for chunk in run.model:
        chunk.eval()
    totals = {name: [0.0, 0.0] for name in run.loss_names}
    try:
        for _ in range(eval_iters):
            reports = forward_backward(
                run.forward_step,
                data_iterator,
                run.model,
                num_microbatches,
                run.pctx,
                run.schedule_config,
                forward_only=True,
            )
            for name, (s, n) in reduce_loss_reports(reports, run.pctx, run.loss_names).items():
                totals[name][0] += s
                totals[name][1] += n
    finally:
        for chunk in run.model:
            chunk.train()
    # Names nothing reported (e.g. training-only MoE statistics) are left out; the main loss stays.
    main = run.loss_names[0]
    return {
        name: (s / n if n else float("nan")) for name, (s, n) in totals.items() if n or name == main
    }


def _evaluate_and_log(
    run: Run, split: str, iterator: Iterator, result: TrainResult, collector: ManualGC
) -> float:
    t = run.cfg.training
    collector.collect()
    calc = run.batch_calculator
    global_batch = calc.global_batch_size
    num_microbatches = global_batch // (calc.micro_batch_size * run.pctx.dp_size)
    start = time.perf_counter()
    losses = evaluate(run, iterator, t.eval_iters, num_microbatches)
    loss = losses[run.loss_names[0]]
    if split == "valid":
        run.state.consumed_valid_samples += t.eval_iters * global_batch
        result.valid_losses[run.state.iteration] = loss
    else:
        result.test_loss = loss
    run.metrics.log_evaluation(
        {
            "iteration": run.state.iteration,
            "split": split,
            **losses,
            **{f"{name}_ppl": math.exp(min(value, 700.0)) for name, value in losses.items()},
            "ppl": math.exp(min(loss, 700.0)),
            "eval_iters": t.eval_iters,
            "eval_time_s": time.perf_counter() - start,
        }
    )
    return loss


def _save(run: Run, result: TrainResult, collector: ManualGC) -> None:
    if run.save_checkpoint is None or result.last_saved_iteration == run.state.iteration:
        return
    collector.collect()
    run.timers("save-checkpoint").start()
    note = run.save_checkpoint(run.state)
    run.timers("save-checkpoint").stop()
    result.last_saved_iteration = run.state.iteration
    run.metrics.message(
        note or f"saved checkpoint at iteration {run.state.iteration} to {run.cfg.checkpoint.save}"
    )


@dataclass
class LogWindow:
    """Sums over the iterations since the last log line."""

    losses: dict[str, list[float]]  # name -> [sum of iteration means, iterations that had it]
    iterations: int = 0
    time: float = 0.0
    samples: int = 0
    flops: float = 0.0
    # Iterations whose numbers are still on the device: (iteration, step, seconds, samples,
    # flops), read by `_read_pending` when a log line, a save or the end needs them.
    pending: list[tuple[int, DeviceStep, float, int, float]] = field(default_factory=list)

    @classmethod
    def empty(cls, names: Sequence[str]) -> LogWindow:
        return cls({name: [0.0, 0] for name in names})

    def add(self, step: StepResult, seconds: float, samples: int, flops: float) -> None:
        for name, value in step.losses.items():
            self.losses[name][0] += value
            self.losses[name][1] += 1
        self.iterations += 1
        self.time += seconds
        self.samples += samples
        self.flops += flops

    def mean_losses(self) -> dict[str, float | None]:
        return {
            name: (total / count if count else None) for name, (total, count) in self.losses.items()
        }


def _optional_figures(run: Run) -> dict[str, float]:
    """Figures of a log line that flags ask for: --log-params-norm, --log-memory-to-tensorboard."""
    figures: dict[str, float] = {}
    log = run.cfg.logging
    if log.log_params_norm:
        sharded = getattr(run.optimizer, "sharded_params_group", None)
        figures["params_norm"] = get_params_norm(run.model, run.pctx, sharded)
    if log.log_memory_to_tensorboard:
        figures.update(memory_scalars(run.pctx.device))
    return figures


def _current_lr(run: Run) -> float:
    groups = run.optimizer.param_groups
    return float(groups[0]["lr"]) if groups else 0.0


def train(run: Run) -> TrainResult:
    """Train from `run.state` to `run.train_iters` (or an exit condition); see module docstring."""
    cfg, pctx, state = run.cfg, run.pctx, run.state
    t = cfg.training
    result = TrainResult(iteration=state.iteration, exit_reason="finished")
    if state.iteration > 0:
        result.last_saved_iteration = state.iteration  # we resumed from exactly that checkpoint
    start_time = time.perf_counter()
    for chunk in run.model:
        chunk.train()
    if run.validator is None:
        run.validator = ResultValidator(
            cfg, pctx, run.model, run.metrics.message, run.loss_names[0]
        )
    if run.validator.per_step:  # a re-run reads the iteration's micro-batches again
        run.train_iterator = replayable(run.train_iterator)  # (finetune: a new one each epoch)

    profiler = StepProfiler(cfg, pctx.rank, pctx.device)
    try:
        with ManualGC(t.manual_gc, t.manual_gc_interval) as collector:
            return _train_iterations(run, result, start_time, profiler, collector)
    finally:
        profiler.close()


def _train_iterations(
    run: Run, result: TrainResult, start_time: float, profiler: StepProfiler, collector: ManualGC
) -> TrainResult:
    state, t = run.state, run.cfg.training
    window = LogWindow.empty(run.loss_names)
    startup_logged = False
    if t.eval_at_start and state.iteration == 0 and run.valid_iterator is not None:
        _evaluate_and_log(run, "valid", run.valid_iterator, result, collector)

    with ExitSignal(t.exit_signal_handler) as exit_signal:
        while (
            not t.skip_train
            and state.iteration < run.train_iters
            and run.train_iterator is not None
        ):
            global_batch = _run_iteration(run, window, profiler, collector)
            if not startup_logged:
                # After the first step, so that lazily created optimizer state is measured.
                startup_logged = True
                if run.startup_record is not None:
                    run.metrics.log_startup(run.startup_record())
            log_interval = run.cfg.logging.log_interval
            if state.iteration % log_interval == 0 or state.iteration == run.train_iters:
                _log_window(run, window, _read_pending(run, result, window), global_batch)
                window = LogWindow.empty(run.loss_names)
            elif _saves_now(run):
                _read_pending(run, result, window)  # never save a state that failed its check
            _after_iteration(run, result, collector)
            reason = _exit_reason(run, exit_signal, start_time)
            if reason is not None:
                _read_pending(run, result, window)
                return _exit_early(run, result, collector, reason)
    _read_pending(run, result, window)
    return _finish(run, result, collector)


def _saves_now(run: Run) -> bool:
    ckpt = run.cfg.checkpoint
    return bool(ckpt.save and ckpt.save_interval and run.state.iteration % ckpt.save_interval == 0)


def _read_pending(run: Run, result: TrainResult, window: LogWindow) -> StepResult | None:
    """The pending iterations' numbers in one host synchronisation: checked (`check_steps`),
    recorded in `result` and summed in `window`; the last iteration's StepResult."""
    pending, window.pending = window.pending, []
    steps = read_steps([step for _, step, _, _, _ in pending], run.loss_names)
    check_steps(run, [(entry[0], step) for entry, step in zip(pending, steps)])
    for (iteration, _, seconds, samples, flops), step in zip(pending, steps):
        # Skipped (fp16 overflow) iterations count too: their losses are still real ones.
        if step.losses:
            result.train_reports[iteration] = step.losses
        if run.loss_names[0] in step.losses:
            result.train_losses[iteration] = step.losses[run.loss_names[0]]
        window.add(step, seconds, samples, flops)
    return steps[-1] if steps else None


def _run_iteration(run: Run, window: LogWindow, profiler: StepProfiler, collector: ManualGC) -> int:
    """One training iteration and its bookkeeping (its numbers left pending in `window`);
    returns its global batch."""
    state, calc = run.state, run.batch_calculator
    calc.update(state.consumed_train_samples)
    global_batch = calc.get_current_global_batch_size()
    run.metrics.iteration_started(state.iteration + 1)  # a notice if it is slow
    profiler.before_iteration(state.iteration)
    iteration_start = time.perf_counter()
    if state.iteration in run.cfg.training.iterations_to_skip:  # Megatron's numbering, from 0
        skip_batches(run.train_iterator, calc.get())
        step = skipped_step(run)
        run.metrics.message(f"iteration {state.iteration + 1} skipped (--iterations-to-skip)")
    else:
        step = step_on_device(run, calc.get())
    iteration_time = time.perf_counter() - iteration_start
    state.iteration += 1
    profiler.after_iteration(state.iteration)
    collector.after_iteration(state.iteration)
    state.consumed_train_samples += global_batch
    if step.success:
        run.scheduler.step(increment=global_batch)
    else:
        state.skipped_iterations += 1
    flops = run.flops_per_iteration(global_batch)
    state.floating_point_operations_so_far += flops
    window.pending.append((state.iteration, step, iteration_time, global_batch, flops))
    return global_batch


def _log_window(run: Run, window: LogWindow, step: StepResult | None, global_batch: int) -> None:
    """The train record (log line or bar, metrics.jsonl, TensorBoard) of the window."""
    state = run.state
    tokens_per_s = window.samples * run.cfg.model.seq_length / window.time
    # Over the whole window: the batch (and so the FLOPs) may grow during ramp-up.
    utilisation = mfu(window.flops, window.time, run.pctx.world_size, run.peak_flops)
    if run.cfg.logging.log_straggler:  # before the timers are read (and reset) below
        report_stragglers(run.metrics, run.timers.elapsed_ms(reset=False), window.iterations,
                          state.iteration, run.pctx, run.cfg.logging.straggler_minmax_count)  # fmt: skip
    run.metrics.log_iteration(
        {
            "iteration": state.iteration,
            "consumed_samples": state.consumed_train_samples,
            **window.mean_losses(),
            "lr": _current_lr(run),
            "grad_norm": step.grad_norm if step else None,
            "loss_scale": float(run.optimizer.get_loss_scale()),
            "iteration_time_s": window.time / window.iterations,
            "tokens_per_s": tokens_per_s,
            "mfu": utilisation,
            "tflops_per_s": window.flops / window.time / 1e12,
            "skipped_iterations": state.skipped_iterations,
            "num_zeros": step.num_zeros if step else None,
            "global_batch_size": global_batch,
            **{f"time_{k}_ms": v for k, v in run.timers.elapsed_ms().items()},
            **_optional_figures(run),
        },
        train_iters=run.train_iters,
    )


def _after_iteration(run: Run, result: TrainResult, collector: ManualGC) -> None:
    """Validation and checkpoint at their intervals, then the after-iteration hook."""
    t, ckpt, iteration = run.cfg.training, run.cfg.checkpoint, run.state.iteration
    if t.eval_interval and iteration % t.eval_interval == 0 and run.valid_iterator is not None:
        _evaluate_and_log(run, "valid", run.valid_iterator, result, collector)
    if (ckpt.save or ckpt.save_hf) and ckpt.save_interval and iteration % ckpt.save_interval == 0:
        _save(run, result, collector)
    if run.after_iteration is not None:
        run.after_iteration()


def _exit_reason(run: Run, exit_signal: ExitSignal, start_time: float) -> str | None:
    """Exit conditions, decided together by all ranks."""
    t, pctx = run.cfg.training, run.pctx
    # Asked only with --exit-signal-handler: the question is a collective and a host sync.
    if exit_signal.enabled and _any_rank(exit_signal.received, pctx):
        return "signal"
    if t.exit_duration_in_mins is not None and _any_rank(
        (time.perf_counter() - start_time) / 60.0 > t.exit_duration_in_mins, pctx
    ):
        return "exit-duration"
    if t.exit_interval and run.state.iteration % t.exit_interval == 0:
        return "exit-interval"
    return None


def _exit_early(run: Run, result: TrainResult, collector: ManualGC, reason: str) -> TrainResult:
    """Save (with --save), validate when asked, and stop."""
    state = run.state
    if run.cfg.checkpoint.save or run.cfg.checkpoint.save_hf:
        _save(run, result, collector)
    if (
        run.evaluate_on_early_exit
        and run.valid_iterator is not None
        and run.cfg.training.eval_iters > 0
        and state.iteration not in result.valid_losses
    ):
        _evaluate_and_log(run, "valid", run.valid_iterator, result, collector)
    run.metrics.message(f"exiting at iteration {state.iteration} ({reason})")
    result.exit_reason = reason
    result.iteration = state.iteration
    return result


def _finish(run: Run, result: TrainResult, collector: ManualGC) -> TrainResult:
    """The end of the iterations: the last checkpoint, validation and test."""
    state, t = run.state, run.cfg.training
    result.iteration = state.iteration
    if (run.cfg.checkpoint.save or run.cfg.checkpoint.save_hf) and state.iteration > 0:
        _save(run, result, collector)
    if run.valid_iterator is not None and t.eval_iters > 0:
        if state.iteration not in result.valid_losses:
            _evaluate_and_log(run, "valid", run.valid_iterator, result, collector)
    if run.test_iterator is not None and t.eval_iters > 0:
        _evaluate_and_log(run, "test", run.test_iterator, result, collector)
    return result
