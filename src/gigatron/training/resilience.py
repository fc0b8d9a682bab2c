"""Result validation (Megatron's rerun state machine, `--rerun-mode`): tell a transient fault
from a reproducible one by re-running the iteration from the same state.

Before every iteration the validator remembers the random states and starts recording the
micro-batches the iteration reads (`ReplayIterator`). After forward-backward, before the
optimizer step, the loop asks `check`: a non-finite loss or gradient
(`--check-for-nan-in-loss-and-grad`, on by default), a loss spike (`--check-for-spiky-loss`:
10x the largest of the first 100 iterations' losses) or an injected error
(`--error-injection-rate`) rejects the result, the same way on every rank. Under
`validate_results` the iteration is then computed again from the same parameters, random states
and micro-batches:
- the re-run is not rejected (or differs): a transient fault; training continues with the
  re-run's gradients (they are in the buffers) and a line says so;
- the re-run reproduces it: a fault of the data or the model. A non-finite loss stops the run
  with a report naming the iteration and the micro-batches (data-parallel rank, index) whose
  loss was not finite, and `--iterations-to-skip`; a spike is reported and training goes on.
`report_stats` re-runs every iteration and logs, every log interval, how many re-runs differed
and by how much; `disabled` stops at once on a non-finite result. State that an iteration
changes outside the parameters' gradients (an MoE expert-bias update) is not rewound.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gigatron.checkpoint.torch_format import get_rng_state, set_rng_state
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext

SPIKY_LOSS_FACTOR = 10.0  # Megatron's: a loss 10x the largest seen
SPIKE_SAMPLES = 100  # iterations whose losses set the reference before spikes are checked


class ReplayIterator:
    """An iterator that records what one iteration reads, so that the iteration can read it
    again (`rewind`)."""

    def __init__(self, inner: Iterator) -> None:
        self.inner = inner
        self.recorded: list[Any] = []
        self.pending: deque[Any] = deque()

    def __iter__(self) -> ReplayIterator:
        return self

    def __next__(self) -> Any:
        if self.pending:
            return self.pending.popleft()
        item = next(self.inner)
        self.recorded.append(item)
        return item

    def start_iteration(self) -> None:
        self.recorded, self.pending = [], deque()

    def rewind(self) -> None:
        self.pending = deque(self.recorded)


def replayable(iterator: Any) -> Any:
    """`iterator` (or each of a list: virtual pipeline chunks) wrapped in a ReplayIterator."""
    if iterator is None or isinstance(iterator, ReplayIterator):
        return iterator
    if isinstance(iterator, (list, tuple)):
        return type(iterator)(replayable(it) for it in iterator)
    return ReplayIterator(iterator)


def skip_batches(iterator: Any, num_microbatches: int) -> None:
    """Read and drop one iteration's micro-batches (`--iterations-to-skip`)."""
    for it in iterator if isinstance(iterator, (list, tuple)) else [iterator]:
        for _ in range(num_microbatches if it is not None else 0):
            next(it)


def _replay_iterators(iterator: Any) -> list[ReplayIterator]:
    if isinstance(iterator, (list, tuple)):
        return [it for it in iterator if isinstance(it, ReplayIterator)]
    return [iterator] if isinstance(iterator, ReplayIterator) else []


class SpikeDetector:
    """Megatron's `is_unexpectedly_large`: the first `samples` values set the reference (their
    largest); later ones `factor` times larger are spikes."""

    def __init__(self, factor: float = SPIKY_LOSS_FACTOR, samples: int = SPIKE_SAMPLES) -> None:
        self.factor, self.samples = factor, samples
        self.seen, self.largest = 0, 0.0

    def is_spike(self, value: float) -> bool:
        value = abs(value)
        if not math.isfinite(value):
            return False  # non-finite values are the NaN check's
        if self.seen < self.samples:
            self.seen += 1
            self.largest = max(self.largest, value)
            return False
        return value >= self.largest * self.factor


class ErrorInjector:
    """`--error-injection-rate N`: one validation in N is rejected (the same on every rank: one
    seeded generator); `--error-injection-type` says whether its re-run is rejected again."""

    def __init__(self, rate: int, kind: str, seed: int) -> None:
        self.rate, self.kind = rate, kind
        self.random = random.Random(seed)
        self.pending = False  # the iteration's first result was injected

    def first_run(self) -> bool:
        self.pending = self.rate > 0 and self.random.randrange(self.rate) == 0
        return self.pending

    def rerun(self) -> bool:
        """Whether the re-run is rejected again (not for a transient error)."""
        return self.pending and self.kind != "transient_error"


def _any(flags: list[bool], pctx: ParallelContext) -> list[bool]:
    """Each flag, true on every rank when it is true on one."""
    if pctx.world_size == 1 or not dist.is_initialized():
        return flags
    value = torch.tensor([1.0 if f else 0.0 for f in flags], device=pctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in value.tolist()]


def grads_finite(model: list[torch.nn.Module]) -> bool:
    """Whether every gradient of this rank is finite (main_grad buffers, else .grad)."""
    grads = []
    for chunk in model:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)  # FSDP
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


@dataclass
class Computed:
    """What forward-backward gave an iteration: the mean losses by name and this rank's
    per-micro-batch loss reports (name -> [sum, count])."""

    losses: dict[str, float]
    reports: list[dict[str, Any]]
    totals: Any = None  # the loop's reduced [names, 2] (sum, count) tensor the losses came from


@dataclass(frozen=True)
class Problem:
    """One reason a result is rejected; `fatal` ones cannot be trained on."""

    text: str
    fatal: bool


class ResultValidator:
    """`--rerun-mode` for one run (see the module docstring); every method is collective."""

    def __init__(
        self, cfg: Any, pctx: ParallelContext, model: list[torch.nn.Module],
        message: Callable[[str], None], main_loss: str,
    ) -> None:  # fmt: skip
        t = cfg.training
        self.cfg, self.pctx, self.model, self.message, self.main = (
            cfg,
            pctx,
            model,
            message,
            main_loss,
        )
        self.mode = t.rerun_mode
        # fp16 overflows are the loss scaler's: it skips those steps.
        self.check_nan = t.check_for_nan_in_loss_and_grad and not t.fp16
        self.spikes = SpikeDetector() if t.check_for_spiky_loss else None
        self.injector = ErrorInjector(t.error_injection_rate, t.error_injection_type, t.seed)
        self.rng: Any = None
        self.iterators: list[ReplayIterator] = []
        self.stats = [0, 0, 0.0]  # re-runs, re-runs that differed, largest relative difference
        # Validating reads the iteration's losses before its update: one host synchronisation a
        # step (as Megatron's rerun machine). Without a per-step check (--rerun-mode disabled,
        # no spike check, no injection) the step stays free of them and a non-finite value is
        # found when the loop reads the iteration's numbers (training/loop.py).
        self.per_step = (
            self.mode == "report_stats"
            or (self.mode == "validate_results" and self.check_nan)
            or self.spikes is not None
            or t.error_injection_rate > 0
        )

    def _tracker(self) -> Any:
        chunk = self.model[0]
        return getattr(getattr(chunk, "module", chunk), "rng", None)

    def begin(self, iterator: Any) -> None:
        """Before an iteration: remember the random states, record the batches it reads."""
        self.iterators = _replay_iterators(iterator)
        for it in self.iterators:
            it.start_iteration()
        if self.mode != "disabled":
            self.rng = get_rng_state(self._tracker())

    def _rerun(self, redo: Callable[[], Computed]) -> Computed:
        set_rng_state(self.rng, self._tracker())
        for it in self.iterators:
            it.rewind()
        return redo()

    def problems(self, computed: Computed, first_run: bool) -> list[Problem]:
        """Why this result is rejected (the same list on every rank); empty when it is not."""
        value = computed.losses.get(self.main)
        name = self.main.replace("_", " ")
        has_value = value is not None
        loss_bad = self.check_nan and has_value and not math.isfinite(value)
        grad_bad = self.check_nan and not grads_finite(self.model)
        spike = self.spikes is not None and has_value and self._spike(value, first_run)
        injected = self.injector.first_run() if first_run else self.injector.rerun()
        flags = _any([loss_bad, grad_bad, spike, injected], self.pctx)
        largest = self.spikes.largest if self.spikes is not None else 0.0
        texts = [
            Problem(f"the {name} is {value} (not finite)", True),
            Problem("the gradients are not finite", True),
            Problem(f"the {name} {value:.4g} is a spike (over {SPIKY_LOSS_FACTOR:g}x the "
                    f"largest of the first {SPIKE_SAMPLES} iterations, {largest:.4g})", False)
            if spike else None,
            Problem(f"an injected error (--error-injection-type {self.injector.kind})", True),
        ]  # fmt: skip
        return [text for text, flag in zip(texts, flags) if flag and text is not None]

    def _spike(self, value: float, first_run: bool) -> bool:
        if first_run:
            return self.spikes.is_spike(value)
        seen = self.spikes.seen >= self.spikes.samples
        return seen and abs(value) >= self.spikes.largest * self.spikes.factor

    def validate(
        self, iteration: int, computed: Computed, redo: Callable[[], Computed]
    ) -> Computed:
        """The result to train on (the re-run's when there was one, its gradients are in the
        buffers); raises a GigatronError when it cannot be trained on."""
        problems = self.problems(computed, first_run=True)
        if self.mode == "report_stats":
            computed = self._compare(iteration, computed, self._rerun(redo))
        if not problems:
            return computed
        if self.mode != "validate_results":
            return self._stop_or_go_on(iteration, problems, computed, "--rerun-mode " + self.mode)
        again = self._rerun(redo)
        repeated = self.problems(again, first_run=False)
        if not repeated:
            self.message(
                f"warning: iteration {iteration}: {problems[0].text}; a re-run from the same "
                f"state gave {self.main.replace('_', ' ')} {again.losses.get(self.main)}: a "
                "transient fault, "
                "training goes on with the re-run's result"
            )
            return again
        same = _same(computed.losses, again.losses)
        note = "reproduced by a re-run from the same state" if same else "a re-run failed too"
        return self._stop_or_go_on(iteration, repeated, again, note)

    def _stop_or_go_on(
        self, iteration: int, problems: list[Problem], computed: Computed, note: str
    ) -> Computed:
        fatal = [problem for problem in problems if problem.fatal]
        if not fatal:
            self.message(f"warning: iteration {iteration}: {problems[0].text}; {note}")
            return computed
        raise GigatronError(self._report(iteration, fatal[0], computed, note))

    def _report(self, iteration: int, problem: Problem, computed: Computed, note: str) -> str:
        where = self._bad_micro_batches(computed)
        saved = self.cfg.checkpoint.save
        kept = (
            f"the last good checkpoint in {saved} is kept (this state was not saved)"
            if saved
            else "nothing was saved"
        )
        return (
            f"iteration {iteration}: {problem.text}, {note}{where}; training stopped and {kept}. "
            f"Resume and skip it with --iterations-to-skip {iteration - 1} (Megatron counts "
            "iterations from 0), or lower --lr, raise --lr-warmup-iters, set --clip-grad, or "
            "try --bf16/--fp16 loss scaling"
        )

    def _bad_micro_batches(self, computed: Computed) -> str:
        """' (micro-batch 1 of data-parallel rank 0, ...)' naming the non-finite losses."""
        mine = [
            index
            for index, report in enumerate(computed.reports)
            if self.main in report and not torch.isfinite(report[self.main][0]).item()
        ]
        found: list[Any] = [(self.pctx.dp_rank, mine)]
        if self.pctx.world_size > 1 and dist.is_initialized():
            found = [None] * self.pctx.world_size
            dist.all_gather_object(found, (self.pctx.dp_rank, mine))
        named = sorted({(rank, index) for rank, indices in found for index in indices})
        if not named:
            return ""
        return (
            " (" + ", ".join(f"micro-batch {i} of data-parallel rank {r}" for r, i in named) + ")"
        )

    def _compare(self, iteration: int, first: Computed, again: Computed) -> Computed:
        """report_stats: count how the re-run's main loss differs; log every log interval."""
        a, b = first.losses.get(self.main), again.losses.get(self.main)
        differs = a is not None and not _same({"x": a}, {"x": b})
        relative = abs(a - b) / max(abs(a), 1e-30) if differs and math.isfinite(a - b) else 0.0
        self.stats = [self.stats[0] + 1, self.stats[1] + differs, max(self.stats[2], relative)]
        if iteration % self.cfg.logging.log_interval == 0:
            runs, differed, largest = self.stats
            self.message(
                f"result validation (report_stats): {runs} iteration(s) re-run, {differed} "
                f"differed, largest relative {self.main.replace('_', ' ')} difference {largest:.3g}"
            )
            self.stats = [0, 0, 0.0]
        return again


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Bitwise-equal losses (NaN equals NaN)."""
    if a.keys() != b.keys():
        return False
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in ((a[k], b[k]) for k in a))
