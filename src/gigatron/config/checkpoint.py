"""Checkpoint saving and loading options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field, off_switch
from gigatron.config.rules import Section


@dataclass
class CheckpointConfig(Section):
    save: Optional[str] = flag_field(None, "directory to save checkpoints in")
    save_interval: Optional[int] = flag_field(None, "iterations between checkpoints")
    load: Optional[str] = flag_field(None, "directory to resume from")
    finetune: bool = flag_field(False, "load weights only and start at iteration 0")
    pretrained_checkpoint: Optional[str] = flag_field(
        None,
        "checkpoint directory whose weights start the run (weights only): the base model of a "
        "LoRA run (docs/lora.md), the BERT of `gigatron finetune`",
    )
    save_hf: Optional[str] = flag_field(
        None,
        "write a Hugging Face folder DIR/iter_NNNNNNN (config.json, safetensors) at every "
        "--save-interval and at the end, straight from the model (docs/lora.md)",
    )
    no_save_optim: bool = flag_field(False, "do not save the optimizer state")
    no_save_rng: bool = flag_field(False, "do not save the random states")
    no_load_optim: bool = flag_field(False, "do not load the optimizer state")
    no_load_rng: bool = flag_field(False, "do not load the random states")
    ckpt_step: Optional[int] = flag_field(
        None, "load this iteration instead of the one in latest_checkpointed_iteration.txt"
    )
    ckpt_format: str = flag_field(
        "torch",
        "checkpoint format: torch (one file per model-parallel rank, Megatron's legacy layout) or "
        "torch_dist (sharded, loads at any parallel layout)",
        choices=["torch", "torch_dist"],
    )
    auto_detect_ckpt_format: bool = flag_field(
        False, "load a checkpoint in whichever format it was saved (torch or torch_dist)"
    )
    dist_ckpt_strictness: str = flag_field(
        "assume_ok_unexpected",
        "torch_dist loads: what to do with model tensors the checkpoint has and the model lacks "
        "(unexpected) or the model has and the checkpoint lacks (missing); see docs/checkpoints.md",
        choices=[
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ],
    )
    ckpt_convert_format: Optional[str] = flag_field(
        None,
        "after loading, save the checkpoint in this format to --ckpt-convert-save and exit",
        choices=["torch", "torch_dist"],
    )
    ckpt_convert_save: Optional[str] = flag_field(None, "where --ckpt-convert-format writes the converted checkpoint")
    async_save: bool = flag_field(False, "torch_dist: write checkpoints in the background while training continues")
    verify_checkpoint: bool = off_switch(
        "load a checkpoint without checking its files against the checksums saved with it"
    )

    def problems(self) -> list[str]:
        """Conversion on load and asynchronous saving."""
        found = []
        if self.ckpt_convert_format is not None and (self.ckpt_convert_save is None or self.load is None):
            found.append(
                f"--ckpt-convert-format {self.ckpt_convert_format} converts the --load "
                "checkpoint into --ckpt-convert-save DIR; give both"
            )
        if self.ckpt_convert_save is not None and self.ckpt_convert_format is None:
            found.append("--ckpt-convert-save needs --ckpt-convert-format torch or torch_dist")
        if self.async_save and self.ckpt_format != "torch_dist":
            found.append(
                f"--async-save works with --ckpt-format torch_dist (not {self.ckpt_format}); add "
                "--ckpt-format torch_dist or leave --async-save out"
            )
        return found
