"""Megatron-LM's own `torch_dist` checkpoints (its default `--ckpt-format`), loaded at any layout.

Megatron-LM writes PyTorch Distributed Checkpoint files whose tensors have its sharded-state-dict
keys: no `model.` prefix; the transformer layers stacked into one tensor with a leading layer
dimension (`decoder.layers.mlp.linear_fc1.weight` [layers, ...]); the norm before a linear under
Transformer Engine's fused name even for the local spec (`linear_qkv.layer_norm_weight`);
Adam's moments under `optimizer.state.exp_avg.<key>`. Its `common.pt` holds the run's `args`
Namespace, the iteration, the learning-rate schedule and the optimizer's step, and is read by
the allow-list unpickler (torch_files.py): nothing executes.

Loading asks for gigatron's own pieces (dist_format.model_pieces / optimizer_pieces: this rank's
boxes of the full tensors) under Megatron's keys: a piece of layer i becomes the box at i of the
stacked tensor. The distributed optimizer's `dp_reshardable` state (flattened grad-buffer
buckets) is read whole and cut into parameters by megatron_buffers.py.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from gigatron.checkpoint.dcp_io import (
    PieceLoadPlanner,
    SafeFileSystemReader,
    quiet_single_process,
    read_metadata,
    read_tensors,
)
from gigatron.checkpoint.dist_format import (
    COMMON_FILENAME,
    FORMAT_MARKER,
    is_dist_checkpoint,
    model_pieces,
    optimizer_pieces,
    optimizer_state_keys,
)
from gigatron.checkpoint.global_view import Piece
from gigatron.checkpoint.megatron_format import (
    gigatron_name,
    is_megatron_state,
    megatron_mtp_name,
    megatron_te_name,
    rng_to_gigatron,
)
from gigatron.checkpoint.state import LoadFlags, Located, TrainingState, empty_result
from gigatron.checkpoint.torch_format import safe_load, set_rng_state
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext
from gigatron.torch_files import load_megatron_object

_LAYER = re.compile(r"^(?P<block>(?:.*\.)?decoder\.layers)\.(?P<i>\d+)\.(?P<rest>.*)$")
# Sharded keys that are not tensors of the model or its optimizer (read elsewhere or not needed).
_NOT_WEIGHTS = re.compile(r"(_extra_state(/.*)?$|^rng_state|^rerun_state|^optimizer\.)")


def is_megatron_dist(iteration_dir: Path) -> bool:
    """A torch_dist checkpoint Megatron-LM wrote (gigatron's own records its format version)."""
    if not is_dist_checkpoint(iteration_dir):
        return False
    marker = json.loads((iteration_dir / FORMAT_MARKER).read_text())
    return "gigatron_format_version" not in marker


def read_common(iteration_dir: Path) -> dict[str, Any]:
    """Megatron's common.pt (args Namespace, iteration, scheduler, optimizer step)."""
    path = iteration_dir / COMMON_FILENAME
    if not path.is_file():
        raise GigatronError(
            f"{iteration_dir}: {COMMON_FILENAME} is missing; the checkpoint is incomplete"
        )
    common = safe_load(path)
    if not is_megatron_state(common):
        raise GigatronError(f"{path}: its args are not Megatron-LM's Namespace")
    return common


def stored_args(iteration_dir: Path) -> dict[str, Any] | None:
    """The saved Megatron args of a torch_dist iteration directory (None: not Megatron's)."""
    if not is_megatron_dist(iteration_dir):
        return None
    return vars(read_common(iteration_dir)["args"])


# ---- names --------------------------------------------------------------------------------------
def megatron_key(name: str, stored: dict[str, Any]) -> tuple[str, int | None]:
    """Megatron's sharded key of gigatron tensor `name` and its layer index in the stacked
    tensor (None: not a layer tensor). TE's fused norm name when the checkpoint has it."""
    match = _LAYER.match(name)
    if match is None:
        mtp = megatron_mtp_name(name)  # an MTP layer: not stacked, TE's norm names
        return next((k for k in (megatron_te_name(mtp), mtp) if k in stored), mtp), None
    local = f"{match.group('block')}.{match.group('rest')}"
    te = megatron_te_name(local)
    # the experts' stacked weights: [layers, experts, ...] under `mlp.experts.experts.`
    experts = local.replace(".mlp.experts.linear_fc", ".mlp.experts.experts.linear_fc")
    found = next((k for k in (te, experts) if k in stored), local)
    return found, int(match.group("i"))


def _translate(piece: Piece, key: str, layer: int | None, stored: dict[str, Any]) -> Piece:
    if layer is None:
        return Piece(key, piece.tensor, piece.offsets, piece.global_shape)
    saved = stored.get(key)
    layers = tuple(saved.size)[0] if isinstance(saved, TensorStorageMetadata) else layer + 1
    return Piece(
        key, piece.tensor.unsqueeze(0), (layer, *piece.offsets), (layers, *piece.global_shape)
    )


def megatron_pieces(pieces: list[Piece], prefix: str, target: str, stored: dict) -> list[Piece]:
    """gigatron's pieces `<prefix><name>` as the pieces of Megatron's `<target><key>`."""
    out = []
    for piece in pieces:
        name = piece.key[len(prefix) :]
        mine = {k[len(target) :]: v for k, v in stored.items() if k.startswith(target)}
        key, layer = megatron_key(name, mine)
        out.append(_translate(piece, target + key, layer, stored))
    return out


def check_pieces(pieces: list[Piece], metadata: Metadata, iteration_dir: Path, hint: str) -> None:
    """Every piece names a stored tensor of its full shape; else an error naming the key."""
    stored = metadata.state_dict_metadata
    for piece in pieces:
        saved = stored.get(piece.key)
        if not isinstance(saved, TensorStorageMetadata):
            raise GigatronError(
                f"{iteration_dir}: Megatron's checkpoint has no tensor {piece.key}; {hint}"
            )
        if tuple(saved.size) != tuple(piece.global_shape):
            raise GigatronError(
                f"{iteration_dir}: {piece.key} has the shape {tuple(saved.size)} in the checkpoint "
                f"but {tuple(piece.global_shape)} in this model; {hint}"
            )


def unknown_keys(pieces: list[Piece], metadata: Metadata) -> list[str]:
    """The checkpoint's model tensors that no piece of this model reads."""
    read = {piece.key for piece in pieces}
    return sorted(
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
        and not _NOT_WEIGHTS.search(key)
        and key not in read
    )


def check_shard_files(metadata: Metadata, iteration_dir: Path) -> None:
    """Every file the index names is there; else an error naming the missing shards."""
    files = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
    missing = sorted(f for f in files if f and not (iteration_dir / f).is_file())
    if missing:
        raise GigatronError(
            f"{iteration_dir}: the checkpoint's shard file(s) {', '.join(missing)} are missing "
            "(a copy that did not finish, or a file removed); copy them from where the "
            "checkpoint was written, or load another iteration with --ckpt-step"
        )


def load_pieces(pieces: list[Piece], iteration_dir: Path, pctx: ParallelContext) -> None:
    with torch.no_grad(), quiet_single_process():
        dcp.load(
            {},
            storage_reader=SafeFileSystemReader(iteration_dir),
            planner=PieceLoadPlanner(pieces),
            no_dist=pctx.world_size == 1,
        )


# ---- load ---------------------------------------------------------------------------------------
def _load_model(target: TrainingState, metadata: Metadata, iteration_dir: Path, pctx) -> None:
    stored = metadata.state_dict_metadata
    pieces = megatron_pieces(model_pieces(target.model_chunks, pctx, True), "model.", "", stored)
    unknown = unknown_keys(pieces, metadata)
    if unknown:
        raise GigatronError(
            f"{iteration_dir}: Megatron's checkpoint holds tensors this model does not have: "
            f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}; check the model "
            "flags (an architecture gigatron lacks cannot be loaded)"
        )
    check_pieces(pieces, metadata, iteration_dir, "check the model flags")
    load_pieces(pieces, iteration_dir, pctx)


def _optimizer_step(common: dict[str, Any]) -> float:
    """Adam's step count: common.pt's `common_step`, else the iteration (no skipped steps)."""
    state = (common.get("optimizer") or {}).get("state") or {}
    step = state.get("common_step")
    return float(step) if step is not None else float(common.get("iteration", 0))


def _set_step(optimizer: Any, step: float) -> None:
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for main in group["params"]:
            inner.state.setdefault(main, {})["step"] = torch.tensor(step, dtype=torch.float32)


def _load_optimizer(target: TrainingState, common: dict, metadata: Metadata, where: Path, pctx):
    from gigatron.checkpoint.megatron_buffers import load_flat_moments  # (sibling, no cycle)

    optimizer = target.optimizer
    keys = optimizer_state_keys(optimizer)
    stored = metadata.state_dict_metadata
    pieces = optimizer_pieces(optimizer, target.model_chunks, pctx, keys, for_load=True)
    pieces = [p for p in pieces if not p.key.startswith("optimizer.fp32_param.")]
    if any(k.startswith("optimizer.distributed.") for k in stored):
        load_flat_moments(pieces, target.model_chunks, common, where, metadata, pctx)
    else:
        translated = []
        for key in keys:
            prefix = f"optimizer.{key}."
            mine = [p for p in pieces if p.key.startswith(prefix)]
            translated += megatron_pieces(mine, prefix, f"optimizer.state.{key}.", stored)
        check_pieces(translated, metadata, where, "pass --no-load-optim")
        load_pieces(translated, where, pctx)
    optimizer.reload_model_params()  # fp32 main parameters are the loaded weights
    _set_step(optimizer, _optimizer_step(common))
    if target.scheduler is not None:
        target.scheduler.load_state_dict(common["opt_param_scheduler"])


def _result(common: dict[str, Any], located: Located, full_state: bool) -> dict[str, Any]:
    args = vars(common["args"])
    result = empty_result()
    result.update(
        loaded=True, args=common["args"], path=str(located.iteration_dir),
        release=located.release, format="torch_dist",
        num_floating_point_operations_so_far=common.get("num_floating_point_operations_so_far", 0),
    )  # fmt: skip
    if full_state:
        result["iteration"] = int(common.get("iteration", 0))
        for key in ("consumed_train_samples", "consumed_valid_samples"):
            result[key] = int(args.get(key) or 0)
    return result


def load_located(
    located: Located, target: TrainingState, pctx: ParallelContext, cfg: Any
) -> dict[str, Any]:
    """Load Megatron's torch_dist iteration `located` into this rank's part of `target`."""
    flags, where = LoadFlags.of(cfg), located.iteration_dir
    common = read_common(where)
    metadata = read_metadata(where)
    check_shard_files(metadata, where)
    _load_model(target, metadata, where, pctx)
    if flags.optim(located.release) and target.optimizer is not None:
        _load_optimizer(target, common, metadata, where, pctx)
    elif target.optimizer is not None:
        target.optimizer.reload_model_params()
    if flags.rng(located.release):
        _load_rng(where, metadata, common["args"], pctx, target.rng_tracker)
    return _result(common, located, flags.full_state(located.release))


# ---- random states ------------------------------------------------------------------------------
class _BytesPlanner(DefaultLoadPlanner):
    """Reads byte entries (ShardedObjects) as raw bytes; nothing is unpickled here."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = value.read()


def read_bytes(iteration_dir: Path, key: str) -> bytes:
    """The raw bytes of one byte entry of a torch_dist checkpoint (one process)."""
    planner = _BytesPlanner()
    with quiet_single_process():
        dcp.load({key: io.BytesIO()}, storage_reader=SafeFileSystemReader(iteration_dir),
                 planner=planner, no_dist=True)  # fmt: skip
    return planner.state_dict[key]


def _load_rng(where: Path, metadata: Metadata, args: Any, pctx: ParallelContext, tracker) -> None:
    """This rank's random states (ShardedObject `rng_state/shard_<pp>.<tp>_<pp size>.<tp size>`),
    when the layout is the saved one (other layouts keep their own, with a warning)."""
    saved = (args.pipeline_model_parallel_size, args.tensor_model_parallel_size)
    key = f"rng_state/shard_{pctx.pp_rank}.{pctx.tp_rank}_{saved[0]}.{saved[1]}"
    if (pctx.pp_size, pctx.tp_size) != saved or key not in metadata.state_dict_metadata:
        warnings.warn(
            f"{where}: random states are not restored (saved at pp x tp {saved}, this run "
            f"{(pctx.pp_size, pctx.tp_size)}); pass --no-load-rng to silence this",
            stacklevel=3,
        )
        return
    states = load_megatron_object(read_bytes(where, key))
    while isinstance(states, list) and len(states) == 1 and isinstance(states[0], list):
        states = states[0]  # the ShardedObject's list around the per-dp-rank list
    state = rng_to_gigatron(states, tracker)
    set_rng_state(state[pctx.dp_rank % len(state)] if isinstance(state, list) else state, tracker)


# ---- whole model (conversion) -------------------------------------------------------------------
def _gigatron_names(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """gigatron's (name, tensor) entries of one Megatron model tensor (layers unstacked)."""
    if not key.startswith("decoder.layers.") and ".decoder.layers." not in key:
        name = gigatron_name(key)
        return [(name, tensor)] if name is not None else []
    block, rest = key.split("decoder.layers.", 1)
    rest = rest.replace("mlp.experts.experts.linear_fc", "mlp.experts.linear_fc")
    out = []
    for layer in range(tensor.shape[0]):
        name = gigatron_name(f"{block}decoder.layers.{layer}.{rest}")
        if name is not None:
            out.append((name, tensor[layer].clone()))
    return out


def full_model(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of Megatron's torch_dist iteration, whole, in gigatron's names."""
    metadata = read_metadata(iteration_dir)
    check_shard_files(metadata, iteration_dir)
    keys = [
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not _NOT_WEIGHTS.search(key)
    ]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in read_tensors(iteration_dir, keys).items():
        out.update(_gigatron_names(key, tensor))
    return out


# ---- write (gigatron -> Megatron) -----------------------------------------------------------------
_EXTRA_MODULES = (
    "self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2",
)  # fmt: skip
_MTP_LINEARS = tuple(f"{m}.weight" for m in ("eh_proj", *_EXTRA_MODULES))
MEGATRON_MARKER = {
    "sharded_backend": "torch_dist", "sharded_backend_version": 1,
    "common_backend": "torch", "common_backend_version": 1,
}  # fmt: skip


def _empty_extra_state() -> list[None]:
    """What Megatron stores as a local-spec linear's `_extra_state` ShardedObject: the list of
    its objects' data, [None] (DCP pickles a non-tensor entry with torch.save)."""
    return [None]


def megatron_dist_state(model: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A whole gigatron model (tp = pp = 1 names) as Megatron's torch_dist state: layers
    stacked under its keys, Transformer Engine's norm names, the experts' layout, and the empty
    `_extra_state` entries Megatron writes for the local spec."""
    out: dict[str, Any] = {}
    layers: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in model.items():
        match = _LAYER.match(name)
        if match is None:
            out[megatron_te_name(megatron_mtp_name(name)) if name.startswith("mtp.") else name] = (
                tensor
            )
            continue
        key = megatron_te_name(f"{match.group('block')}.{match.group('rest')}")
        key = key.replace(".mlp.experts.linear_fc", ".mlp.experts.experts.linear_fc")
        layers.setdefault(key, {})[int(match.group("i"))] = tensor
    for key, parts in layers.items():
        out[key] = torch.stack([parts[i] for i in sorted(parts)])
    count = max((len(parts) for parts in layers.values()), default=0)
    for module in _EXTRA_MODULES:
        if f"decoder.layers.{module}.weight" in out:
            for i in range(count):
                out[f"decoder.layers.{module}._extra_state/shard_{i}_{count}"] = (
                    _empty_extra_state()
                )
    for key in [k for k in out if k.startswith("mtp.") and k.endswith(_MTP_LINEARS)]:
        out[key[: -len(".weight")] + "._extra_state/shard_0_1"] = _empty_extra_state()
    for fc in ("linear_fc1", "linear_fc2"):
        experts = out.get(f"decoder.layers.mlp.experts.experts.{fc}.weight")
        for i in range(count if experts is not None else 0):
            for e in range(experts.shape[1]):
                key = f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_{count}.{experts.shape[1]}"
                out[key] = _empty_extra_state()
    return out


def save_megatron_dist(
    model: dict[str, torch.Tensor], common: dict[str, Any], iteration_dir: Path
) -> None:
    """Write Megatron's torch_dist files of a whole model into `iteration_dir` (one process;
    `common` is common.pt: args Namespace, iteration, ...)."""
    iteration_dir.mkdir(parents=True)
    with quiet_single_process():
        dcp.save(megatron_dist_state(model),
                 storage_writer=FileSystemWriter(iteration_dir, single_file_per_rank=True,
                                                 thread_count=1), no_dist=True)  # fmt: skip
    torch.save(common, iteration_dir / COMMON_FILENAME)
    (iteration_dir / FORMAT_MARKER).write_text(json.dumps(MEGATRON_MARKER))
