"""Checkpoints written by Megatron-LM itself (`--ckpt-format torch`), read safely and mapped onto
gigatron's model, optimizer and random states.

Reading: a Megatron `model_optim_rng.pt` keeps its run arguments in an `argparse.Namespace` that
holds numpy RNG arrays, `signal.Signals` and Megatron enum values, which torch's weights-only
loader refuses. `load_megatron_file` unpickles it with an allow-list: what the weights-only
loader allows, the Namespace, numpy arrays and dtypes, `signal.Signals`; a class from a
`megatron.*` module (the enums) becomes an inert `StoredValue` holding its name and value,
without importing Megatron. Any other global is refused. The file counts as Megatron's only when
its `args` is a Namespace.

Mapping (`to_gigatron_state`): parameter names are Megatron-Core's; the Transformer Engine spec's
norms fused into the next linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_*`)
become the local spec's `input_layernorm.*` / `pre_mlp_layernorm.*`; `_extra_state` entries are
dropped. The optimizer state is keyed by position in Megatron's parameter groups (the model's
parameters in registration order = the order of the file's `model` entries, split into a group
with weight decay and one without: biases and 1-D tensors); each position is mapped to its
parameter name and then to gigatron's own position of that parameter. `iteration`,
`consumed_train_samples` / `consumed_valid_samples` (kept in `args` by Megatron) and the
learning-rate schedule carry over, so a run continues where Megatron stopped.
"""

from __future__ import annotations

import argparse
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gigatron.checkpoint.megatron_buffers import distributed_entries
from gigatron.checkpoint.megatron_legacy import core_state, is_legacy_model
from gigatron.errors import GigatronError

_TE_NORMS = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".self_attention.linear_qkv.layer_norm_bias": ".input_layernorm.bias",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_bias": ".pre_mlp_layernorm.bias",
}
_LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.weight$"
)
_GROUPED_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<fc>linear_fc[12])\.weight(?P<e>\d+)$"
)
# Megatron-Core's second names of one parameter (BERT's pooler module, T5's head alias).
_CORE_ALIASES = {"pooler.dense.": "pooler.", "lm_head.output_layer.": "output_layer."}
# Buffers (not parameters) a Megatron model may save.
_BUFFERS = re.compile(r"(_extra_state|\.expert_bias|\.local_tokens_per_expert)$")


def is_megatron_state(state: dict[str, Any]) -> bool:
    """Written by Megatron-LM: its `args` Namespace, or a legacy model-class `model`."""
    return isinstance(state.get("args"), argparse.Namespace) or is_legacy_model(state.get("model"))


# ---- arguments --------------------------------------------------------------------------------
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def megatron_args(cfg_dict: dict[str, Any], state: dict[str, Any]) -> argparse.Namespace:
    """Megatron-LM's flat arguments for a gigatron configuration (nested dict) and file."""
    flat = {
        k: v
        for section in cfg_dict.values()
        if isinstance(section, dict)
        for k, v in section.items()
    }
    args = argparse.Namespace(**flat)
    args.norm_epsilon = flat.get("layernorm_epsilon")
    if "add_position_embedding" not in flat:  # older files: Megatron's True unless no positions
        args.add_position_embedding = flat.get("position_embedding_type") != "none"
    dtype = next((d for flag, d in _DTYPES.items() if flat.get(flag)), torch.float32)
    args.params_dtype = dtype
    model = state.get("model") or state.get("model0") or {}
    embedding = model.get("embedding.word_embeddings.weight")
    if embedding is not None:
        args.padded_vocab_size = embedding.shape[0] * int(
            flat.get("tensor_model_parallel_size") or 1
        )
    elif state.get("padded_vocab_size"):  # a torch_dist common.pt: no weights beside it
        args.padded_vocab_size = int(state["padded_vocab_size"])
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        setattr(args, key, int(state.get(key, 0)))
    args.iteration = int(state.get("iteration", 0))
    return args


def saved_args(cfg_dict: dict[str, Any], state: dict[str, Any]) -> OrderedDict:
    """The `args` gigatron's torch format saves: its configuration (a nested dict) whose
    attributes are Megatron-LM's flat arguments, so Megatron's load_checkpoint reads a gigatron
    file without --finetune (it reads `args.num_layers`); torch's weights-only loader keeps an
    OrderedDict's attributes (as it keeps a state dict's `_metadata`)."""
    args = OrderedDict(cfg_dict)
    args.__dict__.update(vars(megatron_args(cfg_dict, state)))
    return args


# ---- names --------------------------------------------------------------------------------------
# An MTP block's transformer layer: `transformer_layer` in megatron-core 0.16 (and in every
# version's torch_dist keys), `mtp_model_layer` in later modules and in gigatron.
_MTP_MEGATRON = re.compile(r"^(mtp\.layers\.\d+)\.transformer_layer\.")
_MTP_GIGATRON = re.compile(r"^(mtp\.layers\.\d+)\.mtp_model_layer\.")


def megatron_mtp_name(name: str) -> str:
    """Megatron-Core 0.16's name of a gigatron MTP-layer tensor (others unchanged)."""
    return _MTP_GIGATRON.sub(r"\1.transformer_layer.", name)


def gigatron_name(name: str) -> str | None:
    """The gigatron name of a Megatron model entry (None: not a weight, e.g. `_extra_state`)."""
    if name.endswith("_extra_state"):
        return None
    name = _MTP_MEGATRON.sub(r"\1.mtp_model_layer.", name)
    for te, local in _TE_NORMS.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    for alias, own in _CORE_ALIASES.items():
        if name.startswith(alias):
            return own + name[len(alias) :]
    return name


def megatron_te_name(name: str) -> str:
    """The Transformer Engine spec name of a gigatron weight (inverse of `gigatron_name`)."""
    for te, local in _TE_NORMS.items():
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def _expert_entry(name: str) -> tuple[str, int] | None:
    """(gigatron name, local expert index) of one expert's weight: SequentialMLP's
    `experts.local_experts.{e}.linear_fc1.weight` or TEGroupedMLP's `experts.linear_fc1.weight{e}`."""
    match = _LOCAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name)
    if match is None:
        return None
    return f"{match.group('prefix')}.{match.group('fc')}.weight", int(match.group("e"))


def model_to_gigatron(model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A Megatron model state dict with gigatron's names; the experts of a MoE layer are stacked
    into gigatron's [local experts, ...] weights."""
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in model.items():
        expert = _expert_entry(name)
        if expert is not None:
            experts.setdefault(expert[0], {})[expert[1]] = tensor
            out.setdefault(expert[0], None)  # keeps the parameter order
            continue
        target = gigatron_name(name)
        if target is not None and isinstance(tensor, torch.Tensor):
            out[target] = tensor
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def megatron_parameter_order(state: dict[str, Any]) -> list[str]:
    """Megatron's parameters in registration order (gigatron names): the file's model entries
    without buffers, chunk after chunk."""
    keys = sorted(k for k in state if re.fullmatch(r"model\d+", k)) or ["model"]
    names = []
    for key in keys:
        for name in state.get(key, {}):
            if not _BUFFERS.search(name):
                target = gigatron_name(name)
                if target is not None and target not in names:  # an alias: one parameter
                    names.append(target)
    return names


def _no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".bias") or tensor.dim() == 1


def _gigatron_parameter_order(model_chunks: list[Any]) -> tuple[list[str], list[torch.Tensor]]:
    """(names, params) in gigatron's optimizer order (optim.optimizer.get_param_groups)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, param in module.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if _no_weight_decay(name, param) else decay).append((name, param))
    ordered = decay + no_decay
    return [n for n, _ in ordered], [p for _, p in ordered]


# ---- optimizer ----------------------------------------------------------------------------------
def _group_positions(order: list[str], model: dict[str, torch.Tensor], groups: list[dict]):
    """Parameter name of each position of Megatron's torch optimizer state: its groups hold
    the parameters with weight decay (wd_mult != 0) or without, in registration order."""
    by_kind = {False: [], True: []}
    for name in order:
        by_kind[_no_weight_decay(name, model[name])].append(name)
    names: list[str] = []
    for index, group in enumerate(groups):
        no_wd = float(group.get("wd_mult", 1.0 if index == 0 else 0.0)) == 0.0
        members = by_kind[no_wd]
        if len(group["params"]) != len(members):
            raise GigatronError(
                f"Megatron optimizer group {index} holds {len(group['params'])} parameters but "
                f"the checkpoint's model has {len(members)} "
                f"{'without' if no_wd else 'with'} weight decay; the optimizer state cannot be "
                "mapped (load with --no-load-optim or --finetune)"
            )
        names += members
        by_kind[no_wd] = []
    return names


def _merged_model(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = model_to_gigatron(state.get("model") or {})
    for key in sorted(k for k in state if re.fullmatch(r"model\d+", k)):
        model.update(model_to_gigatron(state[key]))
    return model


def _entries_by_name(inner: dict, state: dict, order: list[str], model: dict) -> dict[str, dict]:
    """Megatron's torch optimizer state (positions in its groups) keyed by parameter name."""
    positions = _group_positions(order, model, inner["param_groups"])
    saved_state = dict(inner["state"])
    common_step = saved_state.pop("common_step", None)
    flat = [i for group in inner["param_groups"] for i in group["params"]]
    steps = {i: g.get("step") for g in inner["param_groups"] for i in g["params"]}
    out = {}
    for position, index in enumerate(flat):
        entry = dict(saved_state.get(index, {}))
        if entry:
            step = entry.get("step", common_step)
            entry["step"] = steps.get(index) if step is None else step
        out[positions[position]] = entry
    return out


def _stack_experts(entries: dict[str, dict]) -> dict[str, dict]:
    """Per-expert optimizer entries (`local_experts.{e}.linear_fc1.weight`) stacked into
    gigatron's [local experts, ...] parameters; other entries as they are."""
    out, stacked = {}, {}
    for name, entry in entries.items():
        expert = _expert_entry(name)
        if expert is None:
            out[name] = entry
        else:
            stacked.setdefault(expert[0], {})[expert[1]] = entry
    for target, parts in stacked.items():
        first = parts[min(parts)]
        out[target] = {
            key: value if key == "step" else torch.stack([parts[e][key] for e in sorted(parts)])
            for key, value in first.items()
        }
    return out


def saved_entries(saved: Any, state: dict[str, Any], where: Path) -> dict[str, dict]:
    """Megatron's optimizer state of one rank file keyed by gigatron parameter name: torch's
    own, the distributed optimizer's (distrib_optim.pt beside `where`) or a MoE chained
    optimizer (a list: the dense parameters' optimizer, then the experts')."""
    order = megatron_parameter_order(state)
    dense = [n for n in order if _expert_entry(n) is None]
    model = _merged_model(state)
    raw = {n: t for key in state if key == "model" or re.fullmatch(r"model\d+", key)
           for n, t in state[key].items()}  # fmt: skip
    shapes = {**model, **{n: raw[n] for n in order if _expert_entry(n) is not None}}
    parts = saved if isinstance(saved, list) else [saved]
    entries: dict[str, dict] = {}
    for number, part in enumerate(parts):
        inner = part["optimizer"] if "param_groups" not in part else part
        if "param_state_sharding_type" in part or "state" not in inner:
            entries.update(distributed_entries(inner, dense, model, state["args"], where))
            continue
        names = order if len(parts) == 1 else [n for n in order if (n in dense) == (number == 0)]
        entries.update(_stack_experts(_entries_by_name(inner, state, names, shapes)))
    return entries


def optimizer_to_gigatron(
    saved: Any, state: dict[str, Any], model_chunks: list[Any], optimizer: Any, where: Path
) -> dict[str, Any]:
    """A Megatron optimizer state dict in gigatron's layout for `optimizer` (mapped by name)."""
    entries = saved_entries(saved, state, where)
    names, params = _gigatron_parameter_order(model_chunks)
    missing = [n for n in names if n not in entries]
    if missing:
        raise GigatronError(
            f"{where}: the Megatron optimizer state has no entry for {', '.join(missing[:3])}; "
            "load with --no-load-optim or --finetune"
        )
    new_state: dict[int, dict[str, Any]] = {}
    for position, (name, param) in enumerate(zip(names, params)):
        entry = dict(entries.get(name, {}))
        if not entry:
            continue
        if entry.get("step") is not None:
            entry["step"] = torch.as_tensor(float(entry["step"]), dtype=torch.float32)
        for moment in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if moment in entry and tuple(entry[moment].shape) != tuple(param.shape):
                raise GigatronError(
                    f"{where}: optimizer {moment} of {name} has shape "
                    f"{tuple(entry[moment].shape)}, the model's is {tuple(param.shape)}"
                )
        new_state[position] = entry
    template = optimizer.state_dict()
    if "optimizer" not in template:  # gigatron's distributed optimizer: its own sharded files
        raise GigatronError(
            f"{where}: Megatron-LM's torch-format optimizer state loads into gigatron's "
            "non-distributed optimizer only; resume without --use-distributed-optimizer (or "
            "from Megatron's torch_dist format, which loads into either), or pass --no-load-optim"
        )
    result: dict[str, Any] = {
        "optimizer": {"state": new_state, "param_groups": template["optimizer"]["param_groups"]}
    }
    first = saved[0] if isinstance(saved, list) else saved
    if "grad_scaler" in first and first["grad_scaler"] is not None:
        result["grad_scaler"] = first["grad_scaler"]
    if "fp32_from_fp16_params" in first and "fp32_from_fp16_params" in template:
        inner = first["optimizer"] if "param_groups" not in first else first
        order = [n for n in megatron_parameter_order(state) if _expert_entry(n) is None]
        positions = _group_positions(order, _merged_model(state), inner["param_groups"])
        mains = {}
        for group_names, group in zip(_split(positions, inner), first["fp32_from_fp16_params"]):
            mains.update(zip(group_names, group))
        half = [n for n, p in zip(names, params) if p.dtype in (torch.float16, torch.bfloat16)]
        result["fp32_from_fp16_params"] = [mains[n] for n in half]
    return result


def _split(positions: list[str], inner: dict[str, Any]) -> list[list[str]]:
    out, start = [], 0
    for group in inner["param_groups"]:
        out.append(positions[start : start + len(group["params"])])
        start += len(group["params"])
    return out


# ---- random states ------------------------------------------------------------------------------
def rng_to_gigatron(rng: Any, rng_tracker: Any) -> Any:
    """Megatron's random states (numpy's as its get_state tuple) in gigatron's format; tracker
    states of another device kind (CUDA states in a CPU run) are left out."""
    if isinstance(rng, list):
        return [rng_to_gigatron(r, rng_tracker) for r in rng]
    rng = dict(rng)
    np_state = rng.get("np_rng_state")
    if isinstance(np_state, tuple):
        algorithm, keys, pos, has_gauss, cached = np_state
        rng["np_rng_state"] = {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    tracker = rng.get("rng_tracker_states")
    if tracker is not None and rng_tracker is not None and hasattr(rng_tracker, "get_state"):
        current = rng_tracker.get_state()
        saved = tracker.get("model-parallel-rng") if isinstance(tracker, dict) else None
        if saved is None or saved.shape != current.shape or saved.dtype != current.dtype:
            rng["rng_tracker_states"] = None
    return rng


def _head_dim(model_chunks: list[Any]) -> int | None:
    """The attention head size of the model being loaded into (None: not known)."""
    if not model_chunks:
        return None
    config = getattr(getattr(model_chunks[0], "module", model_chunks[0]), "config", None)
    return getattr(config, "kv_channels", None)


def to_gigatron_state(
    state: dict[str, Any],
    model_chunks: list[Any],
    optimizer: Any,
    rng_tracker: Any,
    path: Path,
    load_optimizer: bool,
) -> dict[str, Any]:
    """A Megatron-LM file's content in the shape `load_checkpoint` reads."""
    legacy = is_legacy_model(state.get("model"))
    state = core_state(state, _head_dim(model_chunks))
    args = vars(state["args"]) if state.get("args") is not None else {}
    if legacy and load_optimizer and optimizer is not None and state.get("optimizer") is not None:
        raise GigatronError(
            f"{path}: a legacy Megatron-LM model-class checkpoint: its weights load, its "
            "optimizer state does not; start from it with --finetune (or --no-load-optim)"
        )
    out = dict(state)
    for key in [k for k in state if k == "model" or re.fullmatch(r"model\d+", k)]:
        out[key] = model_to_gigatron(state[key])
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        if key not in out and args.get(key) is not None:
            out[key] = int(args[key])
    if "rng_state" in state:
        out["rng_state"] = rng_to_gigatron(state["rng_state"], rng_tracker)
    if load_optimizer and optimizer is not None and state.get("optimizer") is not None:
        out["optimizer"] = optimizer_to_gigatron(
            state["optimizer"], state, model_chunks, optimizer, path
        )
    return out
