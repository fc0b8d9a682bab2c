"""What a training checkpoint holds (`TrainingState`) and the flags that say what to restore."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

# Keys the formats own; `extra` may not overwrite them.
RESERVED_KEYS = frozenset(
    {"checkpoint_version", "iteration", "args", "optimizer", "opt_param_scheduler", "rng_state"}
)


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


def save_flags(cfg: Any) -> tuple[bool, bool]:
    """(save the optimizer and schedule, save the random states): `--no-save-optim/-rng`."""
    ckpt = getattr(cfg, "checkpoint", None)
    return not getattr(ckpt, "no_save_optim", False), not getattr(ckpt, "no_save_rng", False)


def check_extra(extra: dict[str, Any]) -> None:
    """`extra` may not overwrite the keys a format owns."""
    clash = RESERVED_KEYS.intersection(extra)
    if clash:
        raise ValueError(f"save_checkpoint: extra may not set {sorted(clash)}")


def piecewise_save(save_state: Callable[..., Path]) -> Callable[..., Path]:
    """`save_state(save_dir, state, pctx, cfg, **options)` as `save_checkpoint(save_dir,
    iteration, model_chunks, optimizer, scheduler, pctx, cfg, extra, rng_tracker, **options)`,
    the signature callers used before `TrainingState`."""

    def save_checkpoint(
        save_dir: str | Path,
        iteration: int,
        model_chunks: list[nn.Module],
        optimizer: Any,
        scheduler: Any,
        pctx: Any,
        cfg: Any,
        extra: dict[str, Any] | None = None,
        rng_tracker: Any = None,
        **options: Any,
    ) -> Path:
        """Save the state given piece by piece (collective; see `save_state`)."""
        state = TrainingState(
            model_chunks, optimizer, scheduler, rng_tracker, iteration, dict(extra or {})
        )
        return save_state(save_dir, state, pctx, cfg, **options)

    return save_checkpoint


def piecewise_load(load_state: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`load_state(load_dir, state, pctx, cfg, iteration)` as `load_checkpoint(load_dir,
    model_chunks, optimizer, scheduler, pctx, cfg, rng_tracker, iteration)`."""

    def load_checkpoint(
        load_dir: str | Path,
        model_chunks: list[nn.Module],
        optimizer: Any,
        scheduler: Any,
        pctx: Any,
        cfg: Any,
        rng_tracker: Any = None,
        iteration: int | None = None,
    ) -> dict[str, Any]:
        """Load into the state given piece by piece (see `load_state`). Returns `{loaded,
        iteration, consumed_train_samples, consumed_valid_samples,
        num_floating_point_operations_so_far, args, path, release}`."""
        state = TrainingState(model_chunks, optimizer, scheduler, rng_tracker)
        return load_state(load_dir, state, pctx, cfg, iteration)

    return load_checkpoint
