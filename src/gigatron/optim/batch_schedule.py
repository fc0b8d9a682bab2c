"""How many micro-batches make one iteration, with an optional global-batch ramp-up.

Without ramp-up every iteration has global / (micro x dp) micro-batches. With
`--rampup-batch-size START INCREMENT SAMPLES` (Megatron's semantics) the global batch starts at
START and grows by INCREMENT every SAMPLES / ((GLOBAL - START) / INCREMENT) consumed samples; once
more than SAMPLES samples are consumed it is GLOBAL. Every value it takes must be a multiple of
micro x dp (checked up front, so a bad ramp-up fails before training, not halfway through).
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
        self.rampup = (
            None if rampup_batch_size is None else tuple(int(v) for v in rampup_batch_size)
        )
        if self.rampup is None:
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
        self.num_micro_batches = max(1, self.current_global_batch_size // self.micro_times_dp)

    def get(self) -> int:
        """Micro-batches per data-parallel rank in the current iteration."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Iterations needed to consume `train_samples` (Megatron's count under ramp-up)."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = 0
        consumed = 0
        ramp_samples = self.rampup[2]
        while consumed <= ramp_samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.global_batch_size


def build_num_microbatches_calculator(
    cfg: Any, data_parallel_size: int
) -> NumMicroBatchesCalculator:
    """The calculator for `cfg.training` at this data-parallel size."""
    t = cfg.training
    if t.micro_batch_size is None:
        raise GigatronError("--micro-batch-size is required")
    global_batch_size = t.global_batch_size or t.micro_batch_size * data_parallel_size
    return NumMicroBatchesCalculator(
        global_batch_size, t.micro_batch_size, data_parallel_size, t.rampup_batch_size
    )
