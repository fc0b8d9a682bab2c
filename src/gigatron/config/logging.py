"""Logging and metrics options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field


@dataclass
class LoggingConfig:
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
    no_progress_bar: bool = flag_field(False, "plain log lines even on a terminal")
