"""Logging and metrics options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field
from gigatron.config.rules import Section


@dataclass
class LoggingConfig(Section):
    log_interval: int = flag_field(100, "iterations between log lines")
    metrics_file: Optional[str] = flag_field(
        None, "JSON-lines metrics file; default metrics.jsonl in --save or the working directory"
    )
    tensorboard_dir: Optional[str] = flag_field(None, "write TensorBoard events here")
    wandb_project: Optional[str] = flag_field(None, "Weights & Biases project (when installed)")
    wandb_exp_name: Optional[str] = flag_field(None, "Weights & Biases run name")
    log_throughput: bool = flag_field(
        False, "add the model TFLOP/s per GPU to each log line (metrics.jsonl always has it)"
    )
    timing_log_level: int = flag_field(
        0,
        "1: a line of phase timers (forward-backward, optimizer, checkpoint) after each log line",
        choices=[0, 1, 2],
    )
    log_num_zeros_in_grad: bool = flag_field(False, "count zero gradients and log the number")
    log_params_norm: bool = flag_field(False, "log the norm of all parameters")
    log_memory_to_tensorboard: bool = flag_field(
        False, "write memory use (allocated, reserved, peak; process RSS on CPU) to TensorBoard"
    )
    log_timers_to_tensorboard: bool = flag_field(False, "write the phase timers to TensorBoard")
    log_straggler: bool = flag_field(
        False,
        "every log interval, gather each rank's compute and gradient-sync wait time and name "
        "the slowest ranks (log line and a `straggler` record in metrics.jsonl)",
    )
    straggler_minmax_count: int = flag_field(
        1, "with --log-straggler: how many of the slowest and of the fastest ranks to name"
    )
    log_validation_ppl_to_tensorboard: bool = flag_field(False, "write validation perplexities to TensorBoard")
    logging_level: Optional[int] = flag_field(
        None,
        "Python logging level of gigatron's loggers (10 debug, 20 info, 30 warning, 40 error)",
        default_help="warning",
    )
    profile: bool = flag_field(False, "trace --profile-step-start to --profile-step-end with torch.profiler")
    use_pytorch_profiler: bool = flag_field(False, "--profile with torch.profiler (gigatron's only profiler)")
    profile_step_start: int = flag_field(10, "first profiled iteration")
    profile_step_end: int = flag_field(12, "iteration at which profiling stops")
    profile_ranks: list[int] = flag_field([], "ranks that profile (default: rank 0)", nargs="+")
    record_memory_history: bool = flag_field(
        False, "record CUDA allocation history and dump a snapshot to --memory-snapshot-path"
    )
    memory_snapshot_path: str = flag_field("snapshot.pickle", "where --record-memory-history writes")
    no_progress_bar: bool = flag_field(False, "plain log lines even on a terminal")
