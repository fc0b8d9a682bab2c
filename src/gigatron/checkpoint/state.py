"""What a training checkpoint holds (`TrainingState`) and the flags that say what to restore."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn


@dataclass
class TrainingState:
    """The training loop's state a checkpoint saves and restores, for every format.

    `extra` holds the loop's counters saved at the top level (`consumed_train_samples`,
    `consumed_valid_samples`, `skipped_iterations`, `num_floating_point_operations_so_far`) and
    `gigatron_family`; the configuration is saved from the run's config."""

    model_chunks: list[nn.Module]
    optimizer: Any = None
    scheduler: Any = None
    rng_tracker: Any = None
    iteration: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Located:
    """The iteration of a checkpoint directory to load."""

    load_dir: Path
    iteration_dir: Path
    iteration: int
    release: bool


@dataclass(frozen=True)
class LoadFlags:
    """What to restore besides the weights (`--finetune`, `--no-load-optim`, `--no-load-rng`)."""

    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False

    @classmethod
    def of(cls, cfg: Any) -> LoadFlags:
        ckpt = getattr(cfg, "checkpoint", None)
        return cls(
            bool(getattr(ckpt, "finetune", False)),
            bool(getattr(ckpt, "no_load_optim", False)),
            bool(getattr(ckpt, "no_load_rng", False)),
        )

    def full_state(self, release: bool) -> bool:
        """Whether the optimizer, schedule, random states and counters are wanted at all (a
        release checkpoint and --finetune load weights only)."""
        return not release and not self.finetune

    def optim(self, release: bool) -> bool:
        return self.full_state(release) and not self.no_load_optim

    def rng(self, release: bool) -> bool:
        return self.full_state(release) and not self.no_load_rng


def empty_result() -> dict[str, Any]:
    """What `load` returns when nothing was loaded (a fresh start)."""
    return {
        "loaded": False,
        "iteration": 0,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "num_floating_point_operations_so_far": 0,
        "args": None,
        "path": None,
        "release": False,
    }
