"""Which checkpoint format saves and loads: `--ckpt-format`, `--auto-detect-ckpt-format`.

`save_checkpoint` / `load_checkpoint` have the torch format's signatures and hand the work to
torch_format.py (Megatron's per-rank files) or dist_format.py (torch_dist). A checkpoint's format
is told by its iteration directory: `metadata.json` naming torch_dist, else the torch format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from gigatron.checkpoint import dist_format, torch_format
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext

FORMATS = ("torch", "torch_dist")


def detect_format(iteration_dir: Path) -> str:
    """ "torch_dist" or "torch": the format of the checkpoint in `iteration_dir`."""
    return "torch_dist" if dist_format.is_dist_checkpoint(iteration_dir) else "torch"


def save_checkpoint(
    save_dir: str | Path,
    iteration: int,
    model_chunks: list[nn.Module],
    optimizer: Any,
    scheduler: Any,
    pctx: ParallelContext,
    cfg: Any,
    extra: dict[str, Any] | None = None,
    rng_tracker: Any = None,
    ckpt_format: str | None = None,
) -> Path:
    """Save in `ckpt_format` (default: the config's `--ckpt-format`); collective."""
    fmt = ckpt_format or getattr(getattr(cfg, "checkpoint", None), "ckpt_format", "torch")
    save = dist_format.save_checkpoint if fmt == "torch_dist" else torch_format.save_checkpoint
    return save(
        save_dir, iteration, model_chunks, optimizer, scheduler, pctx, cfg, extra, rng_tracker
    )


def load_checkpoint(
    load_dir: str | Path,
    model_chunks: list[nn.Module],
    optimizer: Any,
    scheduler: Any,
    pctx: ParallelContext,
    cfg: Any,
    rng_tracker: Any = None,
    iteration: int | None = None,
) -> dict[str, Any]:
    """Load the checkpoint in `load_dir` in its format (see module docstring); the result is
    the torch format's `load_checkpoint` result."""
    load_dir = Path(load_dir)
    ckpt_cfg = getattr(cfg, "checkpoint", None)
    if iteration is None:
        iteration = getattr(ckpt_cfg, "ckpt_step", None)
    located = torch_format.locate_iteration(load_dir, iteration) if load_dir.is_dir() else None
    found = detect_format(located[0]) if located is not None else None
    if found != "torch_dist":
        if found == "torch":
            _check_format(load_dir, found, ckpt_cfg)
        return torch_format.load_checkpoint(
            load_dir, model_chunks, optimizer, scheduler, pctx, cfg, rng_tracker, iteration
        )
    _check_format(load_dir, found, ckpt_cfg)
    iteration_dir, _, release = located
    return dist_format.load_iteration(
        iteration_dir, load_dir, model_chunks, optimizer, scheduler, pctx, cfg, rng_tracker,
        release,
    )  # fmt: skip


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
