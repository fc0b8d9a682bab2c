"""How many micro-batches make one iteration, with an optional global-batch ramp-up.

Without ramp-up every iteration has global / (micro x dp) micro-batches. With
`--rampup-batch-size START INCREMENT SAMPLES` (Megatron's semantics) the global batch starts at
START and grows by INCREMENT every SAMPLES / ((GLOBAL - START) / INCREMENT) consumed samples; once
more than SAMPLES samples are consumed it is GLOBAL. Every value it takes must be a multiple of
micro x dp (checked up front, so a bad ramp-up fails before training, not halfway through).

`--step-batch-size-schedule "T0:B0 T1:B1 ..."` (Megatron's step schedule) instead sets the global
batch to Bi once Ti tokens are consumed (thresholds are tokens, converted to samples by dividing
by --seq-length; suffixes K, M, B, T are 1e3, 1e6, 1e9, 1e12; the first threshold must be 0 and
they must increase). The last batch size is the run's global batch size. A batch size that is
not a multiple of micro x dp is an error when the schedule reaches it (a resumed run may use more
ranks than the early entries were written for).
"""

from __future__ import annotations

from typing import Any

from gigatron.errors import GigatronError


class NumMicroBatchesCalculator:
    """Current global batch size and number of micro-batches, updated from consumed samples."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: list[int] | tuple[int, int, int] | None = None,
        step_schedule: list[tuple[int, int]] | None = None,
    ) -> None:
        if micro_batch_size <= 0 or data_parallel_size <= 0 or global_batch_size <= 0:
            raise GigatronError(
                f"--micro-batch-size {micro_batch_size}, data-parallel size {data_parallel_size} "
                f"and --global-batch-size {global_batch_size} must all be positive"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.step_schedule = step_schedule
        if step_schedule is not None:
            if rampup_batch_size is not None:
                raise GigatronError(
                    "--rampup-batch-size and --step-batch-size-schedule both set the batch "
                    "growth; give one"
                )
            global_batch_size = step_schedule[-1][1]
            self.global_batch_size = global_batch_size
        self.rampup = (
            None if rampup_batch_size is None else tuple(int(v) for v in rampup_batch_size)
        )
        if step_schedule is not None:
            self.rampup_samples_per_increment = 0.0
        elif self.rampup is None:
            self._check_divisible(global_batch_size, "--global-batch-size")
            self.rampup_samples_per_increment = 0.0
        else:
            if len(self.rampup) != 3:
                raise GigatronError(
                    f"--rampup-batch-size {list(self.rampup)}: give three numbers: "
                    "start-batch-size batch-size-increment ramp-up-samples"
                )
            start, increment, samples = self.rampup
            if start <= 0 or increment <= 0 or samples < 0:
                raise GigatronError(
                    f"--rampup-batch-size {start} {increment} {samples}: start and increment "
                    "must be positive and the ramp-up samples not negative"
                )
            diff = global_batch_size - start
            if diff < 0:
                raise GigatronError(
                    f"--rampup-batch-size start {start} exceeds --global-batch-size "
                    f"{global_batch_size}; start lower or raise the global batch"
                )
            if diff % increment:
                raise GigatronError(
                    f"--rampup-batch-size: --global-batch-size {global_batch_size} minus start "
                    f"{start} = {diff} is not a multiple of the increment {increment}"
                )
            num_increments = diff // increment
            # With no increment at all the batch is constant from the start.
            self.rampup_samples_per_increment = (
                samples / num_increments if num_increments else float("inf")
            )
            for size in range(start, global_batch_size + 1, increment):
                self._check_divisible(size, "--rampup-batch-size")
        self.current_global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // self.micro_times_dp
        self.update(0)

    def _check_divisible(self, size: int, flag: str) -> None:
        if size % self.micro_times_dp:
            raise GigatronError(
                f"{flag}: global batch size {size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.data_parallel_size} = "
                f"{self.micro_times_dp}; choose sizes that are multiples of {self.micro_times_dp}"
            )

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples`."""
        if self.step_schedule is not None:
            return next(b for t, b in reversed(self.step_schedule) if consumed_samples >= t)
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed_samples > samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return min(start + steps * increment, self.global_batch_size)

    def update(self, consumed_samples: int) -> None:
        """Set the batch size of the next iteration."""
        self.current_global_batch_size = self.global_batch_size_at(consumed_samples)
        if self.step_schedule is not None:
            self._check_divisible(self.current_global_batch_size, "--step-batch-size-schedule")
        self.num_micro_batches = max(1, self.current_global_batch_size // self.micro_times_dp)

    def get(self) -> int:
        """Micro-batches per data-parallel rank in the current iteration."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Iterations needed to consume `train_samples` (Megatron's count under ramp-up)."""
        if self.step_schedule is not None:
            return self._step_schedule_iters(train_samples)
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = 0
        consumed = 0
        ramp_samples = self.rampup[2]
        while consumed <= ramp_samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.global_batch_size

    def _step_schedule_iters(self, train_samples: int) -> int:
        """Iterations of the step schedule until `train_samples` (whole batches of the last
        segment reached, as with a constant batch)."""
        iterations, consumed = 0, 0
        while True:
            batch = self.global_batch_size_at(consumed)
            later = [t for t, _ in self.step_schedule if t > consumed]
            if not later or later[0] >= train_samples:
                return iterations + max(0, train_samples - consumed) // batch
            steps = -(-(later[0] - consumed) // batch)  # ceil: the batch that crosses counts
            iterations += steps
            consumed += steps * batch


def parse_step_batch_size_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """ "T0:B0 T1:B1 ..." -> [(threshold in samples, global batch size), ...] (see module doc)."""
    flag = f"--step-batch-size-schedule {text!r}"
    entries = []
    for item in text.replace(",", " ").split():
        threshold, sep, batch = item.partition(":")
        if not sep:
            raise GigatronError(f"{flag}: {item!r} is not THRESHOLD:BATCH; e.g. '0:16 2.4B:320'")
        tokens, size = _with_suffix(threshold, flag), _with_suffix(batch, flag)
        if size <= 0:
            raise GigatronError(f"{flag}: batch size {size} must be positive")
        entries.append((tokens // seq_length if seq_length else tokens, size))
    entries.sort()
    if not entries or entries[0][0] != 0:
        raise GigatronError(f"{flag}: the first threshold must be 0 (the batch to start with)")
    for (a, _), (b, _) in zip(entries, entries[1:], strict=False):
        if b <= a:
            raise GigatronError(
                f"{flag}: thresholds must increase (two fall on sample {a} at --seq-length "
                f"{seq_length})"
            )
    return entries


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _with_suffix(value: str, flag: str) -> int:
    text = value.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    if multiplier > 1:
        text = text[:-1]
    try:
        return int(float(text) * multiplier)
    except ValueError:
        raise GigatronError(f"{flag}: {value!r} is not a number (K, M, B, T suffixes)") from None


def build_num_microbatches_calculator(
    cfg: Any, data_parallel_size: int
) -> NumMicroBatchesCalculator:
    """The calculator for `cfg.training` at this data-parallel size."""
    t = cfg.training
    if t.micro_batch_size is None:
        raise GigatronError("--micro-batch-size is required")
    global_batch_size = t.global_batch_size or t.micro_batch_size * data_parallel_size
    schedule = (
        parse_step_batch_size_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
        if t.step_batch_size_schedule
        else None
    )
    return NumMicroBatchesCalculator(
        global_batch_size, t.micro_batch_size, data_parallel_size, t.rampup_batch_size, schedule
    )
