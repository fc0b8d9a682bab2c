"""`--ckpt-format torch_dist`: resharding checkpoints on torch.distributed.checkpoint (DCP).

Layout (Megatron's directory conventions):
    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/metadata.json       {"sharded_backend": "torch_dist", ...}: written last
    <dir>/iter_0000100/.metadata           DCP's index of every tensor's chunks (read safely)
    <dir>/iter_0000100/__<rank>_0.distcp    the chunks each rank wrote
    <dir>/iter_0000100/common.pt           iteration, config, schedule, optimizer settings
    <dir>/iter_0000100/rng/rank_00000.pt   each rank's random states
Tensors are stored whole-model: `model.<name>` holds the full parameter (the same names at every
layout), `optimizer.<state>.<name>` the fp32 main parameter (`fp32_param`, mixed precision only)
and the moments (`exp_avg`, `exp_avg_sq`, or SGD's `momentum_buffer`). Each rank writes the
pieces it holds, with their global offsets (global_view.py); DCP writes a replicated piece once.
On load each rank asks for the pieces of its own layout, so any tp / pp / vpp / dp / cp / ep
layout, with or without the distributed optimizer, loads any saved one. The tied output weight
(pp > 1) is not stored: it loads from the word embedding (it holds the same values).

Fully sharded data parallelism (parallel/fully_sharded.py) keeps each parameter and moment as a
DTensor: its local shard is the box at its dim-0 offset of the tensor-parallel tensor. An FSDP
run stores the names of a distributed-optimizer run of its precision: `model.<name>` in the
compute dtype and, under --bf16, `optimizer.fp32_param.<name>` from the fp32 shard (which loads
from `fp32_param` when the checkpoint has it, else from `model`). So checkpoints move between
FSDP and the distributed optimizer at any dp size.

Saving is atomic as in the torch format: everything goes to `iter_N.tmp/`, `metadata.json` is
written once all ranks finished, then rank 0 renames the directory and replaces the tracker file.
Loading runs no code from the files: `common.pt` and the random states load with
`torch.load(weights_only=True)`, DCP reads tensors with `weights_only=True`, and DCP's pickled
`.metadata` is read by a restricted unpickler that accepts only DCP's metadata classes and torch
sizes/dtypes (`SafeFileSystemReader`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from gigatron.checkpoint import dcp_io
from gigatron.checkpoint.dcp_io import (
    PieceLoadPlanner,
    PieceSavePlanner,
    SafeFileSystemReader,
    quiet_single_process,
    read_full_tensors,
    read_metadata,
)
from gigatron.checkpoint.global_view import (
    Piece,
    pieces_of_box,
    pieces_of_flat_shard,
    tensor_layout,
)
from gigatron.checkpoint.integrity import earlier_hint, write_manifest
from gigatron.checkpoint.megatron_format import saved_args
from gigatron.checkpoint.state import (
    LoadFlags,
    Located,
    TrainingState,
    check_extra,
    empty_result,
    piecewise_save,
    save_flags,
)
from gigatron.checkpoint.torch_format import (
    CHECKPOINT_VERSION,
    TMP_SUFFIX,
    config_as_dict,
    get_rng_state,
    iteration_dir_name,
    publish_iteration,
    safe_load,
    set_rng_state,
)
from gigatron.errors import GigatronError
from gigatron.models.lora import is_adapter_name
from gigatron.optim.muon import Muon
from gigatron.optim.offload import PrecisionAwareAdamW
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.fully_sharded import FullyShardedDataParallel

try:  # torch's own rule for where a DTensor's local shard sits (torch 2.11 and later)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - older torch: FSDP2's torch.chunk rule below
    compute_local_shape_and_global_offset = None

FORMAT_MARKER = "metadata.json"
COMMON_FILENAME = "common.pt"
RNG_DIR = "rng"
BACKEND = "torch_dist"
FORMAT_VERSION = 1
WORD_EMBEDDING = "embedding.word_embeddings.weight"
TIED_OUTPUT = "output_layer.weight"


def missing_marker(iteration_dir: Path) -> str | None:
    """What is wrong when `iteration_dir` holds torch_dist files but no valid metadata.json (a
    save that did not finish, or a file removed); None when it is not such a directory."""
    dcp_files = [
        name for name in (".metadata", COMMON_FILENAME) if (iteration_dir / name).is_file()
    ]
    dcp_files += sorted(p.name for p in iteration_dir.glob("*.distcp"))[:1]
    if not dcp_files or is_dist_checkpoint(iteration_dir):
        return None
    marker = iteration_dir / FORMAT_MARKER
    state = "is missing" if not marker.is_file() else f"does not name {BACKEND!r} as its backend"
    return (
        f"{iteration_dir}: holds torch_dist files ({', '.join(dcp_files)}) but its {FORMAT_MARKER} "
        f"{state}; the save did not finish or the file was removed. Load an earlier iteration "
        f"with --ckpt-step, or, if every rank's files are there, write {FORMAT_MARKER} as "
        f'{{"sharded_backend": "{BACKEND}", "sharded_backend_version": 1, '
        f'"gigatron_format_version": {FORMAT_VERSION}}}'
    )


def is_dist_checkpoint(iteration_dir: Path) -> bool:
    """True when `iteration_dir` holds a torch_dist checkpoint (its marker file)."""
    marker = iteration_dir / FORMAT_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("sharded_backend") == BACKEND
    except (ValueError, AttributeError):
        return False


# ---- what a rank holds ------------------------------------------------------------------------
def _modules(model_chunks: list[nn.Module]) -> list[nn.Module]:
    for chunk in model_chunks:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()  # no all-gather may still be writing the parameters
    return [getattr(chunk, "module", chunk) for chunk in model_chunks]


def _local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's memory of `tensor` and its offsets in the tensor-parallel (local) tensor: a
    DTensor's local shard (FSDP: Shard(0) over dp) sits at its dim-0 offset, else all of it."""
    if not isinstance(tensor, DTensor):
        view = tensor.detach()
        return view, (0,) * view.dim()
    local = tensor.to_local().detach()
    if compute_local_shape_and_global_offset is not None:
        shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
    else:  # torch.chunk over the mesh: chunks of ceil(n / size) rows, the last ones maybe empty
        rows, size = tensor.shape[0], tensor.device_mesh.size()
        chunk = -(-rows // size)
        first = min(rows, tensor.device_mesh.get_coordinate()[0] * chunk)
        shape = (min(rows, first + chunk) - first, *tensor.shape[1:])
        offsets = (first,) + (0,) * (tensor.dim() - 1)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"a DTensor shard of shape {tuple(local.shape)} is not {tuple(shape)}")
    return local, tuple(offsets)


def _fsdp_dtypes(model_chunks: list[nn.Module]) -> dict[int, torch.dtype]:
    """The compute dtype of every parameter of FSDP-wrapped chunks (their fp32 shards are the
    main parameters), keyed by id."""
    return {
        id(param): chunk.compute_dtype
        for chunk in model_chunks
        if isinstance(chunk, FullyShardedDataParallel)
        for param in chunk.module.parameters()
    }


def _stored_name(name: str, tensor: torch.Tensor) -> str:
    """The checkpoint name of a model tensor: the tied output weight is the word embedding."""
    if name == TIED_OUTPUT and getattr(tensor, "shared_embedding", False):
        return WORD_EMBEDDING
    return name


def _model_tensors(
    model_chunks: list[nn.Module], frozen_base: bool = False
) -> list[tuple[str, str, torch.Tensor, torch.dtype | None]]:
    """(name, stored name, tensor, dtype to store it in or None: as it is) for every entry of
    the model state dicts of this rank (FSDP chunks store their compute dtype). `frozen_base`:
    instead, the frozen base weights a LoRA-adapted chunk leaves out of its state dict."""
    entries = []
    for chunk, module in zip(model_chunks, _modules(model_chunks)):
        dtype = chunk.compute_dtype if isinstance(chunk, FullyShardedDataParallel) else None
        state = module.state_dict(keep_vars=True)
        if frozen_base:
            state = {
                name: param
                for name, param in module.named_parameters()
                if name not in state and not is_adapter_name(name)
            }
        for name, tensor in state.items():
            entries.append((name, _stored_name(name, tensor), tensor, dtype))
    return entries


def _param_names(model_chunks: list[nn.Module]) -> dict[int, str]:
    return {
        id(param): name
        for module in _modules(model_chunks)
        for name, param in module.named_parameters()
    }


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optimizer


def optimizer_state_keys(optimizer: Any) -> list[str]:
    """Per-element state tensors of the inner optimizer."""
    inner = _inner(optimizer)
    if isinstance(inner, torch.optim.SGD):
        return ["momentum_buffer"] if inner.defaults.get("momentum") else []
    if isinstance(inner, Muon):
        return ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    return ["exp_avg", "exp_avg_sq"]


def _optimizer_slots(optimizer: Any) -> list[tuple[nn.Parameter, torch.Tensor, int | None]]:
    """(model parameter, main tensor, flat start or None) for each tensor the optimizer steps:
    whole parameters, or a distributed-optimizer shard starting at a flat index."""
    if hasattr(optimizer, "shards"):
        return [(s.model_param, s.main, s.start) for s in optimizer.shards]
    pairs = getattr(optimizer, "param_pairs", None)
    if pairs is None:
        pairs = [(p, p) for p in optimizer.get_main_params()]
    return [(model, main, None) for model, main in pairs]


def _slot_pieces(
    key: str,
    param: nn.Parameter,
    tensor: torch.Tensor,
    start: int | None,
    pctx: ParallelContext,
) -> list[Piece]:
    layout = tensor_layout(param, tuple(param.shape), pctx)
    if start is None:
        view, offsets = _local_box(tensor)
        return pieces_of_box(key, view, offsets, layout)
    return pieces_of_flat_shard(key, tensor.detach(), tuple(param.shape), start, layout)


def model_pieces(
    model_chunks: list[nn.Module], pctx: ParallelContext, for_load: bool, frozen_base: bool = False
) -> list:
    """Pieces of every model tensor (saving skips the tied output weight, loading reads it from
    the word embedding); `frozen_base`: of a LoRA model's frozen base (`_model_tensors`)."""
    pieces = []
    for name, stored, tensor, dtype in _model_tensors(model_chunks, frozen_base):
        if stored != name and not for_load:
            continue
        layout = tensor_layout(tensor, tuple(tensor.shape), pctx)
        view, offsets = _local_box(tensor)
        if not for_load and dtype is not None and torch.is_floating_point(view):
            view = view.to(dtype)  # FSDP's fp32 shards are stored as the run's model weights
        pieces.extend(pieces_of_box(f"model.{stored}", view, offsets, layout))
    return pieces


def optimizer_pieces(
    optimizer: Any,
    model_chunks: list[nn.Module],
    pctx: ParallelContext,
    keys: list[str],
    for_load: bool,
) -> list[Piece]:
    """Pieces of the fp32 main parameters (mixed precision) and the `keys` moments. For
    loading, missing moment tensors are created (zeros) first so that there is memory to fill."""
    names = _param_names(model_chunks)
    fsdp_dtypes = _fsdp_dtypes(model_chunks)
    inner = _inner(optimizer)
    pieces = []
    for param, main, start in _optimizer_slots(optimizer):
        name = names[id(param)]
        stored = _stored_name(name, param)
        if stored != name and not for_load:
            continue
        compute_dtype = fsdp_dtypes.get(id(param), param.dtype)
        if compute_dtype != torch.float32 and (main is not param or id(param) in fsdp_dtypes):
            pieces += _slot_pieces(f"optimizer.fp32_param.{stored}", param, main, start, pctx)
        state = inner.state.setdefault(main, {}) if for_load else inner.state.get(main, {})
        # Muon: its matrices have a momentum, the other parameters Adam's moments.
        own = inner.state_keys_of(main) if isinstance(inner, Muon) else keys
        for key in (k for k in keys if k in own):
            if for_load and key not in state:
                state[key] = torch.zeros_like(main, memory_format=torch.preserve_format)
            if key in state:
                pieces += _slot_pieces(f"optimizer.{key}.{stored}", param, state[key], start, pctx)
    return pieces


def optimizer_step(optimizer: Any, pctx: ParallelContext) -> float:
    """The optimizer's step count (the same on every rank; 0 before the first step)."""
    steps = [float(entry["step"]) for entry in _inner(optimizer).state.values() if "step" in entry]
    step = torch.tensor([max(steps, default=0.0)], dtype=torch.float64, device=pctx.device)
    if pctx.world_size > 1:
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return float(step.item())


# ---- save ------------------------------------------------------------------------------------
def _common_state(
    iteration: int,
    optimizer: Any,
    scheduler: Any,
    pctx: ParallelContext,
    cfg: Any,
    extra: dict[str, Any],
    model_chunks: list[nn.Module],
    with_optim: bool,
) -> dict[str, Any]:
    state: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "args": config_as_dict(cfg),
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "num_floating_point_operations_so_far": 0,
        "layout": saving_layout(pctx, len(model_chunks)),
    }
    state.update(extra)
    if with_optim and optimizer is not None:
        groups = [
            {key: value for key, value in group.items() if key != "params"}
            for group in _inner(optimizer).param_groups
        ]
        state["optimizer"] = {
            "param_groups": groups,
            "step": optimizer_step(optimizer, pctx),
            "state_keys": optimizer_state_keys(optimizer),
            "grad_scaler": (
                optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None
            ),
        }
    if with_optim and scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def saving_layout(pctx: ParallelContext, num_chunks: int) -> dict[str, int]:
    """The parallel layout of a run (random states are restored only at the same one)."""
    return {
        "world_size": pctx.world_size,
        "tp": pctx.tp_size,
        "pp": pctx.pp_size,
        "dp": pctx.dp_size,
        "cp": pctx.cp_size,
        "ep": pctx.ep_size,
        "etp": pctx.etp_size,
        "chunks": num_chunks,
    }


def _stage(pieces: list[Piece]) -> list[Piece]:
    """Private copies of the pieces (what an async save writes while training goes on)."""
    return [
        Piece(p.key, p.tensor.detach().to("cpu", copy=True).contiguous(), p.offsets, p.global_shape)
        for p in pieces
    ]


class PendingSave:
    """The parts of a save that finish it: the DCP write (maybe still running) and publish."""

    def __init__(self, save_dir: Path, iteration: int, pctx: ParallelContext, write) -> None:
        self.save_dir = save_dir
        self.iteration = iteration
        self.pctx = pctx
        self.write = write  # a concurrent.futures.Future, or None when already written

    def done(self) -> bool:
        return self.write is None or self.write.done()

    def finish(self) -> None:
        """Wait for the write; rank 0 then writes the marker and publishes the iteration.
        DCP's coordinator (rank 0) finishes only after every rank has written its chunks."""
        if self.write is not None:
            self.write.result()
        tmp = self.save_dir / (iteration_dir_name(self.iteration) + TMP_SUFFIX)
        if self.pctx.rank == 0:
            marker = {
                "sharded_backend": BACKEND,
                "sharded_backend_version": 1,
                "gigatron_format_version": FORMAT_VERSION,
                "iteration": self.iteration,
            }
            (tmp / FORMAT_MARKER).write_text(json.dumps(marker) + "\n")
        write_manifest(tmp, self.pctx)  # collective: rank 0's listing follows its finished write
        if self.pctx.rank == 0:
            publish_iteration(self.save_dir, self.iteration)
        if self.pctx.world_size > 1:
            self.pctx.barrier()  # every rank returns once the checkpoint is published


def start_save(
    save_dir: str | Path,
    state: TrainingState,
    pctx: ParallelContext,
    cfg: Any,
    run_write: Callable[[Callable[[], Any]], Any] | None = None,
    process_group: Any = None,
) -> PendingSave:
    """Write everything of `state` but the tensors and start writing those (collective).

    `run_write(fn)` runs the DCP write: None runs it here and now; an executor's `submit` runs it
    in the background on copies of the tensors (async save; `process_group` must then be a group
    that no other collective uses meanwhile). Returns the save to `finish()`.
    """
    check_extra(state.extra)
    with_optim, with_rng = save_flags(cfg)
    iteration, model_chunks, optimizer = state.iteration, state.model_chunks, state.optimizer
    save_dir = Path(save_dir)
    tmp = save_dir / (iteration_dir_name(iteration) + TMP_SUFFIX)
    if pctx.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crashed save
        (tmp / RNG_DIR).mkdir(parents=True)
    if pctx.world_size > 1:
        pctx.barrier()

    pieces = model_pieces(model_chunks, pctx, for_load=False)
    if with_optim and optimizer is not None:
        pieces += optimizer_pieces(
            optimizer, model_chunks, pctx, optimizer_state_keys(optimizer), for_load=False
        )
    common = _common_state(
        iteration, optimizer, state.scheduler, pctx, cfg, state.extra, model_chunks, with_optim
    )
    vocab = [p.global_shape[0] for p in pieces if p.key == "model." + WORD_EMBEDDING]
    # Megatron-LM reads `args` as a Namespace (args.num_layers, ...): its flat names as attributes
    common["args"] = saved_args(common["args"], {**common, "padded_vocab_size": vocab and vocab[0]})
    if pctx.rank == 0:
        torch.save(common, tmp / COMMON_FILENAME)
    if with_rng:
        torch.save(get_rng_state(state.rng_tracker), tmp / RNG_DIR / f"rank_{pctx.rank:05d}.pt")

    def write(to_write: list[Piece]) -> None:
        with quiet_single_process():
            dcp.save(
                {},
                storage_writer=dcp_io.make_writer(tmp),
                planner=PieceSavePlanner(to_write),
                process_group=process_group,
                no_dist=pctx.world_size == 1,
            )

    if run_write is None:
        write(pieces)
        return PendingSave(save_dir, iteration, pctx, None)
    staged = _stage(pieces)  # training may change the originals while the write runs
    return PendingSave(save_dir, iteration, pctx, run_write(lambda: write(staged)))


def save_state(save_dir: str | Path, state: TrainingState, pctx: ParallelContext, cfg: Any) -> Path:
    """Save `state` as the torch_dist checkpoint of `state.iteration` (collective). Returns the
    iteration directory."""
    start_save(save_dir, state, pctx, cfg).finish()
    if pctx.world_size > 1:
        pctx.barrier()
    return Path(save_dir) / iteration_dir_name(state.iteration)


save_checkpoint = piecewise_save(save_state)


# ---- load ------------------------------------------------------------------------------------
def apply_strictness(
    pieces: list[Piece], metadata: Metadata, strictness: str, iteration_dir: Path
) -> list[Piece]:
    """--dist-ckpt-strictness (Megatron's names) on the model's tensors: `missing` are this
    model's tensors the checkpoint lacks, `unexpected` the checkpoint's model tensors this model
    lacks. raise_*: an error; log_* and return_* (the CLI has no caller to return them to): a
    warning; *_all and ignore_all: missing tensors keep their initial values; otherwise a missing
    tensor stays an error and unexpected ones are not read (assume_ok_unexpected: unchecked)."""
    if strictness == "assume_ok_unexpected":
        return pieces
    requested = {piece.key for piece in pieces}
    stored = {key for key in metadata.state_dict_metadata if key.startswith("model.")}
    missing, unexpected = sorted(requested - stored), sorted(stored - requested)
    reported = {"unexpected": unexpected}
    if strictness.endswith("_all"):
        reported["missing"] = missing
    found = {kind: keys for kind, keys in reported.items() if keys}
    if found:
        text = "; ".join(f"{kind}: {', '.join(keys)}" for kind, keys in found.items())
        if strictness.startswith("raise"):
            raise GigatronError(
                f"{iteration_dir}: the checkpoint does not match the model ({text}); "
                f"--dist-ckpt-strictness {strictness} refuses it"
            )
        if not strictness.startswith("ignore"):
            warnings.warn(
                f"{iteration_dir}: model tensors that do not match ({text})", stacklevel=2
            )
    if strictness in ("log_all", "return_all", "ignore_all"):
        return [piece for piece in pieces if piece.key in stored]
    return pieces


def _check_requests(
    pieces: list[Piece], metadata: Metadata, iteration_dir: Path, hint: str
) -> None:
    stored = metadata.state_dict_metadata
    for piece in pieces:
        saved = stored.get(piece.key)
        if saved is None:
            raise GigatronError(f"{iteration_dir}: holds no tensor {piece.key}; {hint}")
        if not isinstance(saved, TensorStorageMetadata):
            raise GigatronError(f"{iteration_dir}: {piece.key} is not a tensor entry")
        if tuple(saved.size) != tuple(piece.global_shape):
            raise GigatronError(
                f"{iteration_dir}: {piece.key} has the full shape {tuple(saved.size)} in the "
                f"checkpoint but {tuple(piece.global_shape)} in this model; check the model "
                "flags (a padded vocabulary depends on --make-vocab-size-divisible-by x tp: "
                "pass --padded-vocab-size or a divisor that fits both layouts)"
            )


def _load_pieces(pieces: list[Piece], iteration_dir: Path, pctx: ParallelContext) -> None:
    try:
        with torch.no_grad(), quiet_single_process():
            dcp.load(
                {},
                storage_reader=SafeFileSystemReader(iteration_dir),
                planner=PieceLoadPlanner(pieces),
                no_dist=pctx.world_size == 1,
            )
    except CheckpointException as exc:  # a shard missing, truncated or replaced (every rank)
        failures = [failure for failure, _ in exc.failures.values()]
        if failures and isinstance(failures[0], GigatronError):
            raise failures[0] from None
        cause = f"{type(failures[0]).__name__}: {failures[0]}" if failures else "unknown"
        raise GigatronError(
            f"{iteration_dir}: its tensors could not be read ({cause}); the checkpoint is "
            f"damaged: {earlier_hint(iteration_dir)}"
        ) from None


def _set_step(optimizer: Any, step: float) -> None:
    inner = _inner(optimizer)
    if isinstance(inner, Muon) and inner.adam is not None:
        inner = inner.adam  # Muon's own momentum has no step count
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW | PrecisionAwareAdamW):
        return
    for group in inner.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for main in group["params"]:
            device = main.device if on_device else torch.device("cpu")
            inner.state.setdefault(main, {})["step"] = torch.tensor(
                step, dtype=torch.float32, device=device
            )


def _load_optimizer(
    optimizer: Any,
    model_chunks: list[nn.Module],
    pctx: ParallelContext,
    common: dict[str, Any],
    metadata: Metadata,
    iteration_dir: Path,
) -> None:
    saved = common["optimizer"]
    keys = optimizer_state_keys(optimizer)
    saved_keys = list(saved.get("state_keys", []))
    if saved_keys != keys:
        raise GigatronError(
            f"{iteration_dir}: holds optimizer state {saved_keys} but --optimizer "
            f"{optimizer.cfg.optimizer.optimizer} needs {keys}; resume with the same optimizer "
            "or pass --no-load-optim"
        )
    stored = metadata.state_dict_metadata
    if keys and not any(k.startswith(f"optimizer.{keys[0]}.") for k in stored):
        keys = []  # saved before the first step: no moments yet
    pieces = optimizer_pieces(optimizer, model_chunks, pctx, keys, for_load=True)
    has_main = any(k.startswith("optimizer.fp32_param.") for k in stored)
    if not has_main:  # saved from fp32 parameters: main parameters come from the weights
        pieces = [p for p in pieces if not p.key.startswith("optimizer.fp32_param.")]
        optimizer.reload_model_params()
    elif _fsdp_dtypes(model_chunks):  # FSDP shards hold the loaded weights already
        pieces = [p for p in pieces if not p.key.startswith("optimizer.fp32_param.") or p.key
                  in stored]  # fmt: skip
    hint = "it was saved with another model or precision; pass --no-load-optim"
    _check_requests(pieces, metadata, iteration_dir, hint)
    _load_pieces(pieces, iteration_dir, pctx)
    if keys:
        _set_step(optimizer, float(saved["step"]))
    inner = _inner(optimizer)
    groups = saved.get("param_groups", [])
    if len(groups) == len(inner.param_groups):
        for group, values in zip(inner.param_groups, groups):
            group.update({k: v for k, v in values.items() if k not in ("params", "fused")})
    if optimizer.grad_scaler is not None and saved.get("grad_scaler") is not None:
        optimizer.grad_scaler.load_state_dict(saved["grad_scaler"])
    # The model copies of fp32 main shards (distributed optimizer) are the loaded weights
    # already; bf16/fp16 model weights were loaded as saved (the rounding of the main ones).
    for chunk in model_chunks:
        if hasattr(chunk, "start_param_sync") and hasattr(optimizer, "shards"):
            chunk.start_param_sync(force_sync=True)


def _read_common(located: Located) -> dict[str, Any]:
    common_path = located.iteration_dir / COMMON_FILENAME
    if not common_path.is_file():
        raise GigatronError(
            f"--load {located.load_dir}: {common_path} is missing; the checkpoint is incomplete"
        )
    return safe_load(common_path)


def _pieces_to_load(model_chunks: list[nn.Module], pctx: ParallelContext, metadata: Metadata):
    """The model's pieces; for a LoRA-adapted model (its state: the adapters) and a checkpoint
    of the base alone (`--load BASE --finetune`), the base's weights instead, the new adapters
    keeping their initial values (as the torch format does; docs/lora.md)."""
    pieces = model_pieces(model_chunks, pctx, for_load=True)
    adapters = [piece for piece in pieces if is_adapter_name(piece.key)]
    if not adapters:
        return pieces
    stored = metadata.state_dict_metadata
    base = model_pieces(model_chunks, pctx, for_load=True, frozen_base=True)
    if any(p.key in stored for p in adapters) or not any(p.key in stored for p in base):
        return pieces
    return [piece for piece in pieces if not is_adapter_name(piece.key)] + base


def _load_model(
    target: TrainingState, metadata: Metadata, iteration_dir: Path, pctx: ParallelContext, cfg: Any
) -> None:
    strictness = getattr(getattr(cfg, "checkpoint", None), "dist_ckpt_strictness", None)
    pieces = _pieces_to_load(target.model_chunks, pctx, metadata)
    pieces = apply_strictness(pieces, metadata, strictness or "assume_ok_unexpected", iteration_dir)
    _check_requests(pieces, metadata, iteration_dir, "check the model flags against the "
                    "checkpoint's (--num-layers, --num-experts, ...)")  # fmt: skip
    _load_pieces(pieces, iteration_dir, pctx)


def _restore_optimizer(
    target: TrainingState,
    common: dict[str, Any],
    metadata: Metadata,
    iteration_dir: Path,
    pctx: ParallelContext,
) -> None:
    if target.optimizer is not None:
        _load_optimizer(
            target.optimizer, target.model_chunks, pctx, common, metadata, iteration_dir
        )
    if target.scheduler is not None:
        if "opt_param_scheduler" not in common:
            raise GigatronError(
                f"{iteration_dir}: has no learning-rate schedule state; pass --no-load-optim"
            )
        target.scheduler.load_state_dict(common["opt_param_scheduler"])


def _loaded_result(common: dict[str, Any], located: Located, full_state: bool) -> dict[str, Any]:
    result = empty_result()
    result.update(
        loaded=True, args=common.get("args"), path=str(located.iteration_dir),
        release=located.release, format=BACKEND,
        num_floating_point_operations_so_far=common.get("num_floating_point_operations_so_far", 0),
    )  # fmt: skip
    if full_state:
        result["iteration"] = int(common.get("iteration", 0))
        for key in ("consumed_train_samples", "consumed_valid_samples", "skipped_iterations"):
            result[key] = int(common.get(key, 0))
    return result


def load_located(
    located: Located, target: TrainingState, pctx: ParallelContext, cfg: Any
) -> dict[str, Any]:
    """Load the torch_dist iteration `located` into this rank's part of `target` (the model,
    and the optimizer, schedule and random states per the flags). Returns what
    `formats.load_checkpoint` returns."""
    flags, release, iteration_dir = LoadFlags.of(cfg), located.release, located.iteration_dir
    common = _read_common(located)
    metadata = read_metadata(iteration_dir)
    optimizer = target.optimizer
    if flags.optim(release) and optimizer is not None and "optimizer" not in common:
        raise GigatronError(
            f"{iteration_dir}: has no optimizer state (saved with --no-save-optim); pass "
            "--no-load-optim or --finetune"
        )
    _load_model(target, metadata, iteration_dir, pctx, cfg)
    if flags.optim(release):
        _restore_optimizer(target, common, metadata, iteration_dir, pctx)
    elif optimizer is not None:
        # Weights only: the fp32 main params must start from the loaded model weights.
        optimizer.reload_model_params()
    if flags.rng(release):
        _load_rng(iteration_dir, common, pctx, len(target.model_chunks), target.rng_tracker)
    return _loaded_result(common, located, flags.full_state(release))


def _load_rng(
    iteration_dir: Path,
    common: dict[str, Any],
    pctx: ParallelContext,
    num_chunks: int,
    rng_tracker: Any,
) -> None:
    """Each rank's random states, when the layout is the saved one (other layouts have other
    random streams: they keep their own, with a warning)."""
    path = iteration_dir / RNG_DIR / f"rank_{pctx.rank:05d}.pt"
    if common.get("layout") != saving_layout(pctx, num_chunks):
        warnings.warn(
            f"{iteration_dir}: saved with the parallel layout {common.get('layout')}, loaded at "
            f"{saving_layout(pctx, num_chunks)}: random states are not restored (they belong to "
            "the saved layout's ranks); pass --no-load-rng to silence this",
            stacklevel=3,
        )
        return
    if not path.is_file():
        raise GigatronError(
            f"{iteration_dir}: has no random states for rank {pctx.rank} (saved with "
            "--no-save-rng); pass --no-load-rng"
        )
    set_rng_state(safe_load(path), rng_tracker)


__all__ = [
    "PendingSave",
    "is_dist_checkpoint",
    "load_located",
    "missing_marker",
    "read_full_tensors",
    "save_checkpoint",
    "save_state",
    "start_save",
]
