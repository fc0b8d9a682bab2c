"""The training loop: batches, length, precision, evaluation, exits, determinism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field, off_switch
from gigatron.config.rules import Section, positive_problems


@dataclass
class TrainingConfig(Section):
    micro_batch_size: Optional[int] = flag_field(None, "samples per micro-batch per data-parallel rank")
    global_batch_size: Optional[int] = flag_field(None, "samples per iteration over all ranks")
    rampup_batch_size: Optional[list[int]] = flag_field(
        None, "start increment samples: grow the global batch linearly", nargs=3
    )
    train_iters: Optional[int] = flag_field(None, "iterations to train")
    train_samples: Optional[int] = flag_field(None, "samples to train (instead of --train-iters)")
    eval_interval: Optional[int] = flag_field(None, "iterations between evaluations")
    eval_iters: int = flag_field(100, "iterations per evaluation")
    eval_at_start: bool = flag_field(
        False, "also evaluate on the validation set before the first iteration (gigatron extra)"
    )
    full_validation: bool = flag_field(False, "evaluate on the whole validation set")
    skip_train: bool = flag_field(False, "only evaluate")
    exit_interval: Optional[int] = flag_field(None, "stop at an iteration divisible by this")
    exit_duration_in_mins: Optional[float] = flag_field(None, "stop after this many minutes")
    exit_signal_handler: bool = flag_field(False, "on SIGTERM, save a checkpoint and exit")
    seed: int = flag_field(1234, "random seed")
    deterministic_mode: bool = flag_field(False, "bitwise-reproducible runs")
    deprecated_use_mcore_models: bool = flag_field(
        False, "Megatron-Core models (the only kind gigatron has)", flag="--use-mcore-models"
    )
    enable_experimental: bool = flag_field(False, "allow Megatron's experimental features")
    step_batch_size_schedule: Optional[str] = flag_field(
        None,
        "global batch by consumed samples, 'SAMPLES:BATCH ...' (e.g. '0:16 2.4B:320'; K, M, B, T suffixes)",
    )
    check_for_nan_in_loss_and_grad: bool = off_switch("keep training when the loss or gradient norm is not finite")
    rerun_mode: str = flag_field(
        "validate_results",
        "on a rejected result (non-finite loss or gradients, a spike): validate_results re-runs "
        "the iteration from the same state (not reproduced: a transient fault, training goes on; "
        "reproduced: stop with a report), report_stats re-runs every iteration and logs how "
        "often the results differ, disabled stops at once",
        choices=["disabled", "validate_results", "report_stats"],
    )
    check_for_spiky_loss: bool = flag_field(
        False, "reject a loss 10x larger than the largest of the first 100 iterations' losses"
    )
    iterations_to_skip: list[int] = flag_field(
        [], "skip these iterations (counted from 0, Megatron's numbering): data consumed, no update"
    )
    error_injection_rate: int = flag_field(0, "testing: reject one result validation in this many (0: never)")
    error_injection_type: str = flag_field(
        "transient_error",
        "testing: what an injected rejection does on its re-run (transient_error: not reproduced)",
        choices=["correct_result", "transient_error", "persistent_error"],
    )
    manual_gc: bool = flag_field(False, "disable Python's automatic garbage collector; collect on a schedule")
    manual_gc_interval: int = flag_field(
        0, "with --manual-gc: iterations between collections (0: only at evaluations and saves)"
    )
    empty_unused_memory_level: int = flag_field(
        0,
        "release cached accelerator memory: 1 after each optimizer step, 2 also after forward-backward",
        choices=[0, 1, 2],
    )
    fp16: bool = flag_field(False, "fp16 parameters with dynamic loss scaling")
    bf16: bool = flag_field(False, "bf16 parameters")
    loss_scale: Optional[float] = flag_field(None, "static loss scale (fp16); default dynamic")
    initial_loss_scale: float = flag_field(2.0**32, "initial dynamic loss scale")
    min_loss_scale: float = flag_field(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = flag_field(1000, "iterations without overflow before the scale grows")
    hysteresis: int = flag_field(2, "overflows tolerated before the scale shrinks")
    torch_compile: bool = flag_field(
        False,
        "torch.compile each transformer layer (inductor) for training; the model's other parts "
        "stay eager (gigatron extra; docs/performance.md)",
    )

    def problems(self) -> list[str]:
        """Batch sizes, training length and precision."""
        found = positive_problems(
            (
                (self.micro_batch_size, "--micro-batch-size"),
                (self.global_batch_size, "--global-batch-size"),
                (self.train_iters, "--train-iters"),
            )
        )
        if self.train_iters is not None and self.train_samples is not None:
            found.append("--train-iters and --train-samples both given; keep one")
        if self.fp16 and self.bf16:
            found.append("--fp16 and --bf16 both given; choose one precision")
        if self.rampup_batch_size is not None and self.train_iters is not None:
            found.append("--rampup-batch-size works with --train-samples; replace --train-iters")
        return found
