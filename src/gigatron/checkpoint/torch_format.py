"""Megatron's legacy per-rank `torch` checkpoint format: atomic saves, safe loads.

Layout (as Megatron-LM writes it):
    <dir>/latest_checkpointed_iteration.txt      the iteration number, or "release"
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt          pp = 1: mp_rank_{tp:02d}
    <dir>/iter_0000100/mp_rank_00_001/model_optim_rng.pt      pp > 1: mp_rank_{tp:02d}_{pp:03d}
    <dir>/iter_0000100/mp_rank_00_001_002/...                  ep > 1: `_{ep:03d}` appended
(With ep > 1 and pp = 1 the name is mp_rank_{tp:02d}_{ep:03d}, as Megatron writes it; the
saved configuration tells it from a pipeline rank.) Each file holds the weights of its (tp, pp)
position, with the experts of its expert-parallel rank.

Each file is a dict of tensors and plain Python values only: `checkpoint_version` 3.0,
`iteration`, `model` (or `model0`, `model1`, ... one per virtual pipeline chunk), `optimizer`,
`opt_param_scheduler`, `rng_state`, `consumed_train_samples`, `consumed_valid_samples`,
`num_floating_point_operations_so_far`, and `args` = the gigatron config as a nested dict (not an
argparse Namespace, so that `torch.load(weights_only=True)` reads it): an OrderedDict whose
attributes are Megatron-LM's flat arguments (`megatron_format.saved_args`), so Megatron's own
load_checkpoint reads a gigatron file without --finetune.

Saving is atomic: every rank writes into `iter_XXXXXXX.tmp/`; after a barrier rank 0 renames it
to `iter_XXXXXXX/` and then replaces `latest_checkpointed_iteration.txt` (temp file +
os.replace). A crash at any point leaves the previous checkpoint and tracker file intact.
Loading never unpickles code: `torch.load(weights_only=True)`; a file that needs more is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gigatron.checkpoint.integrity import write_manifest
from gigatron.checkpoint.megatron_format import (
    is_megatron_state,
    saved_args,
    to_gigatron_state,
)
from gigatron.checkpoint.state import (
    LoadFlags,
    Located,
    TrainingState,
    check_extra,
    empty_result,
    piecewise_load,
    piecewise_save,
    save_flags,
)
from gigatron.errors import GigatronError
from gigatron.parallel.checkpoint_writer import writes_checkpoint
from gigatron.parallel.context import ParallelContext
from gigatron.torch_files import safe_load

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
TMP_SUFFIX = ".tmp"
_MP_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def mp_rank_dir_name(
    tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1
) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_size == 1 else f"{name}_{ep_rank:03d}"


def rank_dir_name(pctx: ParallelContext) -> str:
    """This rank's `mp_rank_*` directory name."""
    return mp_rank_dir_name(pctx.tp_rank, pctx.pp_rank, pctx.pp_size, pctx.ep_rank, pctx.ep_size)


def checkpoint_file(
    root: str | Path, iteration: int, pctx: ParallelContext, release: bool = False
) -> Path:
    """Path of this rank's `model_optim_rng.pt` for `iteration`."""
    return (
        Path(root)
        / iteration_dir_name(iteration, release)
        / rank_dir_name(pctx)
        / CHECKPOINT_FILENAME
    )


def convert_command_hint(load_dir: str | Path, tp: int, pp: int, ep: int = 1) -> str:
    hint = (
        f"gigatron convert-checkpoint --load {load_dir} --save <new dir> "
        f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}"
    )
    return hint + (f" --target-expert-parallel-size {ep}" if ep > 1 else "")


# ---- random states --------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Tuples -> lists recursively (the python RNG state is nested tuples of ints)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def get_rng_state(rng_tracker: Any = None) -> dict[str, Any]:
    """Every random stream of this process, as tensors and plain values."""
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "random_rng_state": _plain(random.getstate()),
        "np_rng_state": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": None,
    }
    if rng_tracker is not None:
        if hasattr(rng_tracker, "get_states"):
            state["rng_tracker_states"] = dict(rng_tracker.get_states())
        else:
            state["rng_tracker_states"] = {"model-parallel-rng": rng_tracker.get_state()}
    return state


def set_rng_state(state: dict[str, Any], rng_tracker: Any = None) -> None:
    random.setstate(_tuples(state["random_rng_state"]))
    np_state = state["np_rng_state"]
    np.random.set_state(
        (
            np_state["algorithm"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker_states = state.get("rng_tracker_states")
    if rng_tracker is not None and tracker_states is not None:
        if hasattr(rng_tracker, "set_states"):
            rng_tracker.set_states(tracker_states)
        else:
            rng_tracker.set_state(tracker_states["model-parallel-rng"])


# ---- config as plain data -------------------------------------------------------------------
def _plain_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_value(v) for v in value]
    # Anything else (a dtype, a path) is stored by its text so the file stays weights-only.
    return str(value)


def config_as_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested dicts of plain values."""
    if cfg is None:
        return {}
    if dataclasses.is_dataclass(cfg):
        return _plain_value(dataclasses.asdict(cfg))
    if isinstance(cfg, argparse.Namespace):
        return _plain_value(vars(cfg))
    return _plain_value(dict(cfg))


# ---- save -----------------------------------------------------------------------------------
def _barrier(pctx: ParallelContext) -> None:
    if pctx.world_size > 1:
        pctx.barrier()


def _model_state(model_chunks: list[nn.Module]) -> dict[str, Any]:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].state_dict()}
    return {f"model{i}": chunk.state_dict() for i, chunk in enumerate(model_chunks)}


def _write_file(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def publish_iteration(save_dir: Path, iteration: int) -> None:
    """Rank 0: make the finished `.tmp` directory the checkpoint, then point the tracker at it."""
    final = save_dir / iteration_dir_name(iteration)
    tmp = save_dir / (final.name + TMP_SUFFIX)
    if final.exists():
        # Re-saving an iteration: move the old copy aside first so a crash keeps one of the two.
        old = save_dir / (final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    tracker_tmp = save_dir / (TRACKER_FILENAME + TMP_SUFFIX)
    tracker_tmp.write_text(f"{iteration}\n")
    os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)


def _rank_state(state: TrainingState, cfg: Any, with_optim: bool, with_rng: bool) -> dict:
    """The dict one rank file holds."""
    saved: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        "args": config_as_dict(cfg),
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "num_floating_point_operations_so_far": 0,
    }
    saved.update(state.extra)
    saved.update(_model_state(state.model_chunks))
    saved["args"] = saved_args(saved["args"], saved)  # Megatron-LM reads its attributes
    if with_optim:
        if state.optimizer is not None:
            saved["optimizer"] = state.optimizer.state_dict()
        if state.scheduler is not None:
            saved["opt_param_scheduler"] = state.scheduler.state_dict()
    if with_rng:
        saved["rng_state"] = get_rng_state(state.rng_tracker)
    return saved


def save_state(save_dir: str | Path, state: TrainingState, pctx: ParallelContext, cfg: Any) -> Path:
    """Save this rank's part of `state` as the checkpoint of `state.iteration` (collective:
    every rank calls it). `state.extra` adds top-level keys (`consumed_train_samples`, ...).
    Returns the iteration directory."""
    check_extra(state.extra)
    with_optim, with_rng = save_flags(cfg)
    save_dir = Path(save_dir)
    final = save_dir / iteration_dir_name(state.iteration)
    tmp = save_dir / (final.name + TMP_SUFFIX)

    if pctx.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crashed save
        tmp.mkdir()
    _barrier(pctx)

    rank_dir = tmp / rank_dir_name(pctx)
    # A sharded (distributed) optimizer writes its own per-rank state (collective over dp).
    optimizer = state.optimizer
    if optimizer is not None and hasattr(optimizer, "save_sharded_state") and with_optim:
        optimizer.save_sharded_state(rank_dir)
    if writes_checkpoint(pctx):
        _write_file(_rank_state(state, cfg, with_optim, with_rng), rank_dir / CHECKPOINT_FILENAME)
    _barrier(pctx)
    write_manifest(tmp, pctx)  # every file's checksum, checked at load
    if pctx.rank == 0:
        publish_iteration(save_dir, state.iteration)
    _barrier(pctx)
    return final


# ---- load -----------------------------------------------------------------------------------
def read_tracker(load_dir: Path) -> tuple[int, bool] | None:
    """(iteration, release) from the tracker file, or None when there is none."""
    tracker = load_dir / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise GigatronError(
            f"{tracker}: holds {text!r}, not an iteration number or 'release'; fix or delete it"
        ) from None
    if iteration < 0:
        raise GigatronError(f"{tracker}: iteration {iteration} is negative; fix or delete it")
    return iteration, False


def saved_layout(iteration_dir: Path, expert_parallel: bool = False) -> tuple[int, int, int] | None:
    """(tp, pp, ep) sizes read from the `mp_rank_*` directory names, or None when there are
    none. A name with two numbers is (tp, pp), or (tp, ep) when `expert_parallel` (Megatron's
    names do not tell them apart; the saved configuration does)."""
    ranks: list[tuple[int, int, int]] = []
    for entry in iteration_dir.iterdir():
        match = _MP_RANK_DIR.match(entry.name)
        if match and entry.is_dir():
            numbers = [int(g) for g in match.groups() if g is not None]
            if len(numbers) == 3:
                ranks.append((numbers[0], numbers[1], numbers[2]))
            elif len(numbers) == 2:
                second = numbers[1]
                ranks.append(
                    (numbers[0], 0, second) if expert_parallel else (numbers[0], second, 0)
                )
            else:
                ranks.append((numbers[0], 0, 0))
    if not ranks:
        return None
    return tuple(max(r[i] for r in ranks) + 1 for i in range(3))  # type: ignore[return-value]


def _parallel_sizes(args: Any) -> dict[str, int | None]:
    """tp / pp / virtual chunk counts from a saved config (ours nested, Megatron's flat)."""
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    if not isinstance(args, dict):
        return {}
    flat = dict(args.get("parallel", {})) if isinstance(args.get("parallel"), dict) else {}
    flat.update({k: v for k, v in args.items() if not isinstance(v, dict)})
    return {
        "tp": flat.get("tensor_model_parallel_size"),
        "pp": flat.get("pipeline_model_parallel_size"),
        "vp": flat.get("num_virtual_stages_per_pipeline_rank")
        or flat.get("virtual_pipeline_model_parallel_size"),
        "ep": flat.get("expert_model_parallel_size") or 1,
    }


def _layout_error(load_dir: Path, saved: str, pctx: ParallelContext, now: str) -> GigatronError:
    return GigatronError(
        f"--load {load_dir}: the checkpoint was saved with {saved} but this run uses {now}; "
        "a torch-format checkpoint loads only into the layout it was saved with. Run with the "
        "saved layout, or convert it: "
        + convert_command_hint(load_dir, pctx.tp_size, pctx.pp_size, pctx.ep_size)
    )


def _load_model(state: dict[str, Any], model_chunks: list[nn.Module], path: Path) -> None:
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for key, chunk in zip(keys, model_chunks):
        if key not in state:
            raise GigatronError(f"{path}: has no '{key}' entry; it holds {sorted(state)}")
        try:
            chunk.load_state_dict(state[key], strict=True)
        except RuntimeError as exc:
            raise GigatronError(
                f"{path}: the saved weights do not fit this model ({exc}); check the model flags "
                "(--num-layers, --hidden-size, ...) against the checkpoint"
            ) from None


def check_fresh_start(load_dir: Path, save_dir: str | Path | None) -> None:
    """`--load DIR` without a checkpoint in it starts from scratch only when that is plainly
    meant: DIR is the --save directory (resuming a run that has not saved yet) or an existing
    empty directory. Anything else is most likely a wrong path and must not silently restart
    training from iteration 0."""
    same_as_save = save_dir is not None and Path(save_dir).resolve() == load_dir.resolve()
    if same_as_save:
        return
    if not load_dir.exists():
        raise GigatronError(
            f"--load {load_dir}: no such directory (and it is not the --save directory); check "
            "the path, or leave --load out to start from scratch"
        )
    if not load_dir.is_dir():
        raise GigatronError(f"--load {load_dir}: not a directory; give a checkpoint directory")
    if any(load_dir.iterdir()):
        raise GigatronError(
            f"--load {load_dir}: holds no {TRACKER_FILENAME}, so no checkpoint, but is not empty; "
            "point --load at a directory written with --save (or give --ckpt-step), or leave "
            "--load out to start from scratch"
        )


def _check_saved_states(
    state: dict[str, Any], path: Path, wants_optim: bool, no_load_optim: bool, no_load_rng: bool
) -> None:
    """Name what a checkpoint lacks and the flags that load it anyway."""
    missing_optim = wants_optim and not no_load_optim and "optimizer" not in state
    missing_rng = not no_load_rng and state.get("rng_state") is None
    if not (missing_optim or missing_rng):
        return
    converted = state.get("converted_from")
    if converted is not None or ("optimizer" not in state and state.get("rng_state") is None):
        origin = (
            f"was written by `gigatron convert-checkpoint` (from {converted})"
            if converted is not None
            else "holds model weights only (as `gigatron convert-checkpoint` writes them)"
        )
        raise GigatronError(
            f"{path}: {origin}: it has no optimizer, learning-rate schedule or random states; "
            "pass --no-load-optim --no-load-rng to continue training from its weights, or "
            "--finetune to also start again at iteration 0"
        )
    if missing_optim:
        raise GigatronError(
            f"{path}: has no optimizer state (saved with --no-save-optim); pass "
            "--no-load-optim or --finetune"
        )
    raise GigatronError(
        f"{path}: has no random states (saved with --no-save-rng); pass --no-load-rng"
    )


def loaded_message(load_dir: str | Path, loaded: dict[str, Any]) -> str:
    """The line a run prints after load_checkpoint found a checkpoint."""
    if loaded.get("release"):
        return f"loaded release checkpoint {load_dir} (weights only): starting at iteration 0"
    if loaded["iteration"] == 0 and loaded.get("path"):
        return f"loaded the weights of checkpoint {load_dir}: starting at iteration 0"
    return (
        f"loaded checkpoint {load_dir} at iteration {loaded['iteration']} "
        f"(consumed samples {loaded['consumed_train_samples']})"
    )


def locate_iteration(load_dir: Path, iteration: int | None = None) -> tuple[Path, int, bool] | None:
    """(iteration directory, iteration, is release) to load: `iteration` if given, else the one
    the tracker file names; None when neither exists. A named directory that is missing raises."""
    release = False
    if iteration is None:
        tracked = read_tracker(load_dir) if load_dir.is_dir() else None
        if tracked is None:
            return None
        iteration, release = tracked
    iteration_dir = load_dir / iteration_dir_name(iteration, release)
    if not iteration_dir.is_dir():
        raise GigatronError(
            f"--load {load_dir}: iteration directory {iteration_dir.name} is missing; check "
            f"{TRACKER_FILENAME} or --ckpt-step"
        )
    return iteration_dir, iteration, release


def locate_for_load(load_dir: str | Path, cfg: Any, iteration: int | None) -> Located | None:
    """The iteration of `load_dir` to load (`iteration`, else --ckpt-step, else the tracker
    file's); None for a fresh start, which `check_fresh_start` allows and a warning names."""
    load_dir = Path(load_dir)
    ckpt_cfg = getattr(cfg, "checkpoint", None)
    if iteration is None:
        iteration = getattr(ckpt_cfg, "ckpt_step", None)
    found = locate_iteration(load_dir, iteration)
    if found is not None:
        return Located(load_dir, *found)
    check_fresh_start(load_dir, getattr(ckpt_cfg, "save", None))
    warnings.warn(
        f"--load {load_dir}: no checkpoint there yet; starting from scratch at iteration 0",
        stacklevel=4,
    )
    return None


def load_state(
    load_dir: str | Path,
    target: TrainingState,
    pctx: ParallelContext,
    cfg: Any,
    iteration: int | None = None,
) -> dict[str, Any]:
    """Load this rank's part of the torch-format checkpoint in `load_dir` into `target` (see
    `locate_for_load` for which one, `load_located` for what is restored)."""
    located = locate_for_load(load_dir, cfg, iteration)
    return empty_result() if located is None else load_located(located, target, pctx, cfg)


def _check_layout(located: Located, pctx: ParallelContext) -> None:
    """The checkpoint's mp_rank_* directories must be this run's tp x pp x ep layout."""
    layout = saved_layout(located.iteration_dir, expert_parallel=pctx.ep_size > 1)
    if layout is None:
        raise GigatronError(
            f"--load {located.load_dir}: {located.iteration_dir.name} holds no mp_rank_* "
            "directories; it is not a torch-format checkpoint (gigatron reads Megatron's torch "
            "format and torch_dist)"
        )
    if layout != (pctx.tp_size, pctx.pp_size, pctx.ep_size):
        saved = f"tensor-parallel {layout[0]}, pipeline-parallel {layout[1]}" + (
            f", expert-parallel {layout[2]}" if layout[2] > 1 else ""
        )
        raise _layout_error(located.load_dir, saved, pctx, _layout_now(pctx))


def _layout_now(pctx: ParallelContext) -> str:
    return f"tensor-parallel {pctx.tp_size}, pipeline-parallel {pctx.pp_size}" + (
        f", expert-parallel {pctx.ep_size}" if pctx.ep_size > 1 else ""
    )


def _check_saved_sizes(
    state: dict[str, Any], located: Located, pctx: ParallelContext, num_chunks: int
) -> None:
    """The saved expert-parallel size and virtual chunk count must be this run's."""
    sizes = _parallel_sizes(state.get("args"))
    if sizes.get("ep", 1) != pctx.ep_size:
        raise _layout_error(
            located.load_dir, f"expert-parallel {sizes.get('ep')}", pctx, _layout_now(pctx)
        )
    saved_chunks = sum(1 for k in state if re.fullmatch(r"model\d+", k)) or 1
    if saved_chunks != num_chunks:
        raise _layout_error(
            located.load_dir,
            f"{saved_chunks} virtual pipeline chunk(s) per rank (vp {sizes.get('vp')})",
            pctx,
            f"{num_chunks}",
        )


def _read_rank_file(
    located: Located, target: TrainingState, pctx: ParallelContext, flags: LoadFlags
) -> tuple[dict[str, Any], Path]:
    """This rank's file, in gigatron's names (a Megatron-LM file is translated)."""
    path = located.iteration_dir / rank_dir_name(pctx) / CHECKPOINT_FILENAME
    if not path.is_file():
        raise GigatronError(
            f"--load {located.load_dir}: {path} is missing; the checkpoint is incomplete"
        )
    state = safe_load(path)
    if is_megatron_state(state):  # written by Megatron-LM: its names, optimizer and RNG layout
        state = to_gigatron_state(
            state,
            target.model_chunks,
            target.optimizer,
            target.rng_tracker,
            path,
            flags.optim(located.release),
        )
    return state, path


def _restore_optimizer(
    state: dict[str, Any], path: Path, target: TrainingState, load_optim: bool
) -> None:
    optimizer, scheduler = target.optimizer, target.scheduler
    if not load_optim:
        if optimizer is not None and hasattr(optimizer, "reload_model_params"):
            # Weights only: the fp32 main params must start from the loaded model weights.
            optimizer.reload_model_params()
        return
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        if hasattr(optimizer, "load_sharded_state"):
            optimizer.load_sharded_state(path.parent)
    if scheduler is not None:
        key = "opt_param_scheduler" if "opt_param_scheduler" in state else "lr_scheduler"
        if key not in state:
            raise GigatronError(
                f"{path}: has no learning-rate schedule state; pass --no-load-optim"
            )
        scheduler.load_state_dict(state[key])


def _restore_rng(state: dict[str, Any], path: Path, target: TrainingState, dp_rank: int) -> None:
    rng = state.get("rng_state")
    if rng is None:
        raise GigatronError(
            f"{path}: has no random states (saved with --no-save-rng); pass --no-load-rng"
        )
    if isinstance(rng, list):  # Megatron's per-data-parallel-rank list
        rng = rng[dp_rank] if len(rng) > dp_rank else rng[0]
    set_rng_state(rng, target.rng_tracker)


def _loaded_result(
    state: dict[str, Any], path: Path, located: Located, full_state: bool
) -> dict[str, Any]:
    result = empty_result()
    result.update(
        loaded=True,
        args=state.get("args"),
        path=str(path),
        release=located.release,
        num_floating_point_operations_so_far=state.get("num_floating_point_operations_so_far", 0),
    )
    if full_state:
        saved = state.get("iteration", state.get("total_iters", located.iteration))
        result["iteration"] = int(saved)
        result["consumed_train_samples"] = int(state.get("consumed_train_samples", 0))
        result["consumed_valid_samples"] = int(state.get("consumed_valid_samples", 0))
    return result


def load_located(
    located: Located, target: TrainingState, pctx: ParallelContext, cfg: Any
) -> dict[str, Any]:
    """Load the torch-format iteration `located` into `target` (this rank's part); returns
    what `load_checkpoint` returns."""
    flags = LoadFlags.of(cfg)
    release = located.release
    _check_layout(located, pctx)
    state, path = _read_rank_file(located, target, pctx, flags)
    _check_saved_sizes(state, located, pctx, len(target.model_chunks))
    if flags.full_state(release):
        wants_optim = target.optimizer is not None
        _check_saved_states(state, path, wants_optim, flags.no_load_optim, flags.no_load_rng)
    _load_model(state, target.model_chunks, path)
    _restore_optimizer(state, path, target, flags.optim(release))
    if flags.rng(release):
        _restore_rng(state, path, target, pctx.dp_rank)
    return _loaded_result(state, path, located, flags.full_state(release))


save_checkpoint = piecewise_save(save_state)
load_checkpoint = piecewise_load(load_state)
