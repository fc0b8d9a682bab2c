"""Checkpoint saving and loading options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field


@dataclass
class CheckpointConfig:
    save: Optional[str] = flag_field(None, "directory to save checkpoints in")
    save_interval: Optional[int] = flag_field(None, "iterations between checkpoints")
    load: Optional[str] = flag_field(None, "directory to resume from")
    finetune: bool = flag_field(False, "load weights only and start at iteration 0")
    no_save_optim: bool = flag_field(False, "do not save the optimizer state")
    no_save_rng: bool = flag_field(False, "do not save the random states")
    no_load_optim: bool = flag_field(False, "do not load the optimizer state")
    no_load_rng: bool = flag_field(False, "do not load the random states")
    ckpt_step: Optional[int] = flag_field(
        None, "load this iteration instead of the one in latest_checkpointed_iteration.txt"
    )
    ckpt_format: str = flag_field("torch", "checkpoint format", choices=["torch", "torch_dist"])
