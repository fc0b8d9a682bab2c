"""Checkpoint formats as one abstraction: `--ckpt-format`, `--auto-detect-ckpt-format`.

A `CheckpointFormat` says whether an iteration directory is in its format (`detect`), saves a
`TrainingState` (`save`, collective) and loads one (`load`). `torch` (torch_format.py, Megatron's
per-rank files) and `torch_dist` (dist_format.py, DCP shards) are registered here; a checkpoint's
format is the first registered one whose `detect` accepts its iteration directory.
`save_checkpoint` / `load_checkpoint` keep the torch format's signatures for the callers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gigatron.checkpoint import dist_format, megatron_dist, torch_format
from gigatron.checkpoint.gigatron_io import CheckpointSource
from gigatron.checkpoint.integrity import verify_checkpoint
from gigatron.checkpoint.state import (
    Located,
    TrainingState,
    empty_result,
    piecewise_load,
    piecewise_save,
)
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext


@dataclass(frozen=True)
class CheckpointFormat:
    """One on-disk checkpoint format of the training loop."""

    name: str
    detect: Callable[[Path], bool]  # iteration directory -> is it in this format
    save: Callable[[Path, TrainingState, ParallelContext, Any], Path]  # (dir, state, pctx, cfg)
    load: Callable[[Located, TrainingState, ParallelContext, Any], dict[str, Any]]


_REGISTRY: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Make `fmt` a `--ckpt-format` choice of save and load (detected in registration order)."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def get_format(name: str) -> CheckpointFormat:
    if name not in _REGISTRY:
        raise GigatronError(
            f"--ckpt-format {name}: not a checkpoint format; choose one of {', '.join(_REGISTRY)}"
        )
    return _REGISTRY[name]


def _is_torch_checkpoint(iteration_dir: Path) -> bool:
    return iteration_dir.is_dir() and torch_format.saved_layout(iteration_dir) is not None


def _load_dist(located: Located, state: TrainingState, pctx: ParallelContext, cfg: Any):
    """gigatron's torch_dist, or the one Megatron-LM wrote (its keys, common.pt)."""
    if megatron_dist.is_megatron_dist(located.iteration_dir):
        return megatron_dist.load_located(located, state, pctx, cfg)
    return dist_format.load_located(located, state, pctx, cfg)


register_format(
    CheckpointFormat("torch_dist", dist_format.is_dist_checkpoint, dist_format.save_state,
                     _load_dist)
)  # fmt: skip
register_format(
    CheckpointFormat("torch", _is_torch_checkpoint, torch_format.save_state,
                     torch_format.load_located)
)  # fmt: skip
FORMATS = tuple(_REGISTRY)


def detect_format(iteration_dir: Path) -> str:
    """The name of the format of the checkpoint in `iteration_dir`; "torch" when no format
    recognises it (the torch loader then names what is missing)."""
    return next((f.name for f in _REGISTRY.values() if f.detect(iteration_dir)), "torch")


def saved_header(iteration_dir: Path) -> dict[str, Any]:
    """What a checkpoint records beside its tensors (`args`, `gigatron_family`, consumed
    samples, ...): torch_dist's common.pt, or the torch format's first rank file (mapped)."""
    if detect_format(iteration_dir) == "torch_dist":
        return torch_format.safe_load(iteration_dir / dist_format.COMMON_FILENAME)
    return CheckpointSource.first_state(iteration_dir)


def save_state(
    save_dir: str | Path,
    state: TrainingState,
    pctx: ParallelContext,
    cfg: Any,
    ckpt_format: str | None = None,
) -> Path:
    """Save `state` in `ckpt_format` (default: the config's `--ckpt-format`); collective."""
    name = ckpt_format or getattr(getattr(cfg, "checkpoint", None), "ckpt_format", "torch")
    return get_format(name).save(Path(save_dir), state, pctx, cfg)


def load_state(
    load_dir: str | Path,
    state: TrainingState,
    pctx: ParallelContext,
    cfg: Any,
    iteration: int | None = None,
) -> dict[str, Any]:
    """Load the checkpoint in `load_dir` (latest, `iteration` or `--ckpt-step`) into `state` in
    its own format. Returns `{loaded, iteration, consumed_train_samples, ...}`; a directory
    with no checkpoint yet gives `loaded` False (torch_format.locate_for_load)."""
    located = torch_format.locate_for_load(load_dir, cfg, iteration)
    if located is None:
        return empty_result()
    name = detect_format(located.iteration_dir)
    if not _REGISTRY[name].detect(located.iteration_dir):
        problem = dist_format.missing_marker(located.iteration_dir)
        if problem is not None:
            raise GigatronError(f"--load {located.load_dir}: {problem}")
    else:
        _check_format(located.load_dir, name, getattr(cfg, "checkpoint", None))
    if getattr(getattr(cfg, "checkpoint", None), "verify_checkpoint", True):
        verify_checkpoint(located.iteration_dir, pctx)  # --no-verify-checkpoint skips it
    return _REGISTRY[name].load(located, state, pctx, cfg)


save_checkpoint = piecewise_save(save_state)  # (..., ckpt_format=None): the older signature
load_checkpoint = piecewise_load(load_state)


def _check_format(load_dir: Path, found: str, ckpt_cfg: Any) -> None:
    """Megatron's rule: the checkpoint must be in --ckpt-format unless
    --auto-detect-ckpt-format (or a conversion, which reads any format) is given."""
    wanted = getattr(ckpt_cfg, "ckpt_format", "torch")
    if found == wanted or getattr(ckpt_cfg, "auto_detect_ckpt_format", False):
        return
    if getattr(ckpt_cfg, "ckpt_convert_format", None) is not None:
        return
    raise GigatronError(
        f"--load {load_dir}: holds a {found} checkpoint but --ckpt-format is {wanted}; pass "
        f"--ckpt-format {found} or --auto-detect-ckpt-format"
    )
