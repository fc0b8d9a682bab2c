"""The Megatron distributed optimizer's flattened state: Adam's moments in grad-buffer order.

Megatron-LM's DistributedDataParallel keeps the parameters of a model chunk in contiguous
buffers (one per dtype; the experts' parameters in their own), laid out in reverse registration
order (roughly the backward pass's), each parameter's start padded to 64 elements and the
buffer's end to a multiple of lcm(dp, 128) (a multiple of dp without the distributed
optimizer). Its distributed optimizer saves each moment as one flat tensor per buffer (torch_dist
`dp_reshardable`: `optimizer.distributed.dp_group_idx_0.gbuf_idx_<b>.dtype_(...).bucket_idx_0.
<moment>`), including `param`, the fp32 main parameters. Here the layout is rebuilt from
Megatron's registration order, checked against the saved `param` values (the loaded weights),
and the moments are cut out per parameter.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from gigatron.checkpoint.dcp_io import read_tensors
from gigatron.checkpoint.global_view import Piece, pieces_of_box, tensor_layout
from gigatron.errors import GigatronError
from gigatron.torch_files import safe_load

# The order Megatron's modules register their parameters in (a transformer layer, then the model).
_LAYER_ORDER = (
    "input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
    "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
    "mlp.router.", "mlp.linear_fc1.", "mlp.linear_fc2.", "mlp.experts.", "mlp.shared_experts.",
)  # fmt: skip
_MODEL_ORDER = (
    "embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
    "decoder.final_layernorm.", "output_layer.",
)  # fmt: skip
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.(.*)\.bucket_idx_(\d+)\.(\w+)$"
)


def _position(prefixes: tuple[str, ...], name: str) -> int:
    return next((i for i, p in enumerate(prefixes) if name.startswith(p)), len(prefixes))


def registration_key(name: str) -> tuple:
    """Sort key: Megatron's registration order of a parameter (weights before biases)."""
    match = _LAYER.match(name)
    layer, rest = (int(match.group(1)), match.group(2)) if match else (-1, name)
    return (
        _position(_MODEL_ORDER, name), layer, _position(_LAYER_ORDER, rest),
        0 if rest.endswith("weight") else 1, rest,
    )  # fmt: skip


def buffer_layout(
    params: list[tuple[str, int]], dp_size: int, distributed: bool
) -> tuple[dict[str, tuple[int, int]], int]:
    """(name -> (start, end), padded size) of one Megatron grad buffer holding `params`
    ((name, numel) in registration order), in one bucket."""
    index, start, end = {}, 0, 0
    for name, numel in reversed(params):
        if distributed:
            start = math.ceil(start / 64) * 64
        end = start + numel
        index[name] = (start, end)
        start = end
    divisor = math.lcm(dp_size, 128) if distributed else 1
    return index, math.ceil(end / divisor) * divisor


def fits(numel: int, layout: dict[str, tuple[int, int]], size: int) -> bool:
    """A saved flat moment covers the buffer: Megatron leaves out the end padding past the
    last parameter (its `numel_unpadded`), so any length from there to the padded size."""
    return max(end for _, end in layout.values()) <= numel <= size


def _model_params(model_chunks: list[Any]) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, parameter, is expert) of every trainable parameter, in Megatron's order."""
    out = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, param in module.named_parameters():
            if param.requires_grad:
                out.append((name, param, bool(getattr(param, "expert_parallel", False))))
    return sorted(out, key=lambda entry: registration_key(entry[0]))


def _buckets(metadata: Metadata) -> dict[tuple[int, int], dict[str, str]]:
    """(dp group index, gbuf index) -> moment name -> stored key (one bucket per buffer)."""
    out: dict[tuple[int, int], dict[str, str]] = {}
    for key in metadata.state_dict_metadata:
        match = _BUCKET.match(key)
        if match is not None:
            if int(match.group(4)) != 0:
                raise GigatronError(f"{key}: a grad buffer of several buckets is not read yet")
            where = (int(match.group(1)), int(match.group(2)))
            out.setdefault(where, {})[match.group(5)] = key
    return out


def _saved_rank(tp_rank: int, tp_size: int) -> Any:
    """The ranks `tensor_layout` reads, for tensor-parallel rank `tp_rank` of the saved run."""
    return SimpleNamespace(
        tp_rank=tp_rank, tp_size=tp_size, etp_rank=tp_rank, etp_size=tp_size, ep_rank=0, ep_size=1
    )


def _saved_shapes(param: torch.Tensor, pctx: Any, tp: int) -> tuple[tuple, tuple]:
    """(shape on a rank of the saved tp `tp`, full shape) of a parameter of this run."""
    full = tensor_layout(param, tuple(param.shape), pctx).global_shape
    local, dim = list(full), getattr(param, "partition_dim", -1)
    if getattr(param, "tensor_model_parallel", False) and dim >= 0:
        local[dim] //= tp
    return tuple(local), full


def _check_layout(args: Any, params: list, where: Path) -> int:
    """The saved tensor-parallel size (pipeline-parallel saves are refused)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) != 1:
        raise GigatronError(
            f"{where}: distributed-optimizer state saved at pp > 1 is not read yet; "
            "pass --no-load-optim"
        )
    if tp > 1 and any(expert for _, _, expert in params):
        raise GigatronError(
            f"{where}: the experts' distributed-optimizer state saved at tp > 1 is not read "
            "yet; pass --no-load-optim"
        )
    return tp


def _cut(flat: torch.Tensor, members: list, shapes: dict, args: Any, key: str) -> dict:
    """gigatron name -> the tp-local tensor of one saved rank's flat moment `flat`."""
    layout, size = buffer_layout(
        [(n, math.prod(shapes[n][0])) for n, _, _ in members], args.data_parallel_size, True
    )
    if not fits(flat.numel(), layout, size):
        raise GigatronError(
            f"{key} holds {flat.numel()} values, this model's buffer {size}; check the model flags"
        )
    return {n: flat[slice(*layout[n])].view(shapes[n][0]) for n, _, _ in members}


def _place(full: dict, local: dict, members: list, shapes: dict, saved: Any) -> None:
    """Put one saved rank's tp-local tensors (`local`) at their place in the full tensors."""
    for name, param, _ in members:
        whole = full.setdefault(name, torch.empty(shapes[name][1], dtype=local[name].dtype))
        layout = tensor_layout(param, shapes[name][0], saved)
        for piece in pieces_of_box(name, local[name], (0,) * local[name].dim(), layout):
            whole[_box(piece)] = piece.tensor


def _full_moments(model_chunks, args: Any, metadata: Metadata, where: Path, pctx) -> dict:
    """moment -> gigatron name -> full tensor, cut from the saved flat buffers of every saved
    tensor-parallel rank (its dp group index) and put at their place in the full tensors."""
    params = _model_params(model_chunks)
    tp = _check_layout(args, params, where)
    groups = [[p for p in params if not p[2]], [p for p in params if p[2]]]
    buckets = _buckets(metadata)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for gbuf, members in enumerate(g for g in groups if g):
        shapes = {n: _saved_shapes(p, pctx, tp) for n, p, _ in members}
        for rank in range(tp):
            keys = buckets.get((rank, gbuf))
            if keys is None:
                raise GigatronError(
                    f"{where}: has no distributed-optimizer buffer {gbuf} of tp rank {rank}"
                )
            flat = read_tensors(where, list(keys.values()))
            for moment, key in keys.items():
                local = _cut(flat[key], members, shapes, args, key)
                _place(
                    moments.setdefault(moment, {}), local, members, shapes, _saved_rank(rank, tp)
                )
    return moments


def _box(piece: Piece) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))


def _check_params(moments: dict[str, dict], model_chunks, where: Path, pctx) -> None:
    """The saved fp32 `param` values equal the loaded weights: the layout was rebuilt right."""
    saved = moments.get("param", {})
    for name, param, _ in _model_params(model_chunks):
        if name not in saved:
            continue
        layout = tensor_layout(param, tuple(param.shape), pctx)
        local = param.detach().float()
        for piece in pieces_of_box(name, local, (0,) * local.dim(), layout):
            if not torch.equal(saved[name][_box(piece)], piece.tensor):
                raise GigatronError(
                    f"{where}: the distributed optimizer's state does not line up with the "
                    f"model ({name}); pass --no-load-optim"
                )


def load_flat_moments(
    pieces: list[Piece], model_chunks: list[Any], common: dict[str, Any], where: Path,
    metadata: Metadata, pctx: Any,
) -> None:  # fmt: skip
    """Fill gigatron's optimizer pieces (`optimizer.<moment>.<name>`) from the flat buffers."""
    moments = _full_moments(model_chunks, common["args"], metadata, where, pctx)
    _check_params(moments, model_chunks, where, pctx)
    for piece in pieces:
        moment, name = piece.key.split(".", 2)[1:]
        full = moments.get(moment, {}).get(name)
        if full is None:
            raise GigatronError(f"{where}: the distributed optimizer saved no {moment} of {name}")
        piece.tensor.copy_(full[_box(piece)])


def distributed_entries(
    inner: dict[str, Any], order: list[str], model: dict[str, torch.Tensor], args: Any,
    where: Path,
) -> dict[str, dict]:  # fmt: skip
    """The torch format's distributed-optimizer state (`distrib_optim.pt` beside the rank file
    `where`) keyed by parameter name: moments cut from the flat buffer of the dense parameters
    (`order`: Megatron's registration order, local shapes in `model`), the step of its group."""
    path = Path(where).parent / "distrib_optim.pt"
    if not path.is_file():
        raise GigatronError(
            f"{path} is missing: the distributed optimizer's state; pass --no-load-optim"
        )
    buffers = safe_load(path)
    if set(k for k in buffers if isinstance(k, int)) != {0} or len(buffers[0]) != 1:
        raise GigatronError(
            f"{path}: several grad buffers (dtypes or experts) are not read yet; pass --no-load-optim"
        )
    (flat,) = buffers[0].values()
    layout, size = buffer_layout(
        [(n, model[n].numel()) for n in order], args.data_parallel_size, True
    )
    if not fits(flat["exp_avg"].numel(), layout, size):
        raise GigatronError(
            f"{path}: holds {flat['exp_avg'].numel()} values per moment, this model's buffer {size}"
        )
    for name in order:
        start, end = layout[name]
        if "param" in flat and not torch.equal(
            flat["param"][start:end].view(model[name].shape), model[name].float()
        ):
            raise GigatronError(
                f"{path}: the distributed optimizer's state does not line up with the model ({name}); pass --no-load-optim"
            )
    entries = {}
    for group in inner["param_groups"]:
        no_decay = float(group.get("wd_mult", 1.0)) == 0.0
        for name in order:
            if (name.endswith(".bias") or model[name].dim() == 1) != no_decay:
                continue
            start, end = layout[name]
            entries[name] = {
                moment: flat[moment][start:end].view(model[name].shape).clone()
                for moment in ("exp_avg", "exp_avg_sq")
            }
            entries[name]["step"] = group.get("step")
    return entries
