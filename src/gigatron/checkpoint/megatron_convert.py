"""`gigatron convert --from megatron` / `--to megatron`: checkpoints in Megatron-LM's own shape.

To Megatron: every `mp_rank_*` file of a gigatron checkpoint is rewritten with Megatron-LM's
`args` (an `argparse.Namespace` of flat Megatron argument names; gigatron's field names are
Megatron's `dest` names) and the parameter names of the local layer spec, or of the Transformer
Engine spec (`--megatron-te-names`: norms fused into the next linear, an empty `_extra_state`
per Transformer Engine module). Model weights only, as `convert-checkpoint` writes: Megatron-LM
loads them with `--finetune` (or `--no-load-optim --no-load-rng`).

From Megatron (`stage_megatron`, the conversion pipeline's `megatron` reader): the files are
read with the Megatron allow-list (megatron_format.py), renamed to gigatron's names and given a
gigatron configuration made from their `args`; the pipeline then re-splits them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.megatron_dist import (
    full_model,
    is_megatron_dist,
    read_common,
    save_megatron_dist,
)
from gigatron.checkpoint.megatron_format import (
    megatron_args,
    megatron_mtp_name,
    megatron_te_name,
    model_to_gigatron,
)
from gigatron.checkpoint.megatron_legacy import core_state
from gigatron.checkpoint.torch_format import (
    CHECKPOINT_FILENAME,
    TMP_SUFFIX,
    TRACKER_FILENAME,
    config_as_dict,
    locate_iteration,
    safe_load,
)
from gigatron.config.root import FIELD_SECTION, config_from_dict, parse_config
from gigatron.errors import GigatronError

_TE_MODULES = (
    "self_attention.core_attention",
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


# A linear of the local spec: Megatron saves an (empty) `_extra_state` after its weight.
_LOCAL_LINEAR = re.compile(
    r"^(.*\.(linear_proj|linear_qkv|linear_fc1|linear_fc2|eh_proj))\.weight$"
)
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<fc>linear_fc[12])\.weight$")


def _te_model(model: dict[str, torch.Tensor], layers: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {megatron_te_name(name): tensor for name, tensor in model.items()}
    for layer in sorted(layers):
        for module in _TE_MODULES:
            out[f"{layer}.{module}._extra_state"] = None
    return out


def _sequential_experts(model: dict[str, Any], extra_states: bool) -> dict[str, Any]:
    """gigatron's stacked [local experts, ...] weights as Megatron's SequentialMLP entries
    (`experts.local_experts.{e}.linear_fc1.weight`, each linear's empty `_extra_state`)."""
    out: dict[str, Any] = {}
    for name, tensor in model.items():
        match = _STACKED_EXPERTS.match(name)
        if match is None or tensor is None or tensor.dim() != 3:
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            module = f"{match['prefix']}.local_experts.{e}.{match['fc']}"
            out[f"{module}.weight"] = tensor[e].clone()  # its own storage, as Megatron saves it
            if extra_states:
                out[f"{module}._extra_state"] = None
    return out


def _local_model(model: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The local spec's entries as Megatron saves them: an empty `_extra_state` after each
    linear's weight, and the output layer's (present even when tied) on the last stage."""
    out: dict[str, Any] = {}
    for name, tensor in model.items():
        out[name] = tensor
        match = _LOCAL_LINEAR.match(name)
        if match is not None and ".mlp.experts." not in name:
            out[f"{match[1]}._extra_state"] = None
        if name == "output_layer.weight":
            out["output_layer._extra_state"] = None
    if "decoder.final_layernorm.weight" in model:
        out.setdefault("output_layer._extra_state", None)
    return out


def gigatron_to_megatron(
    load: Path, save: Path, iteration: int | None, te_names: bool, log: Any = print
) -> Path:
    """Rewrite a gigatron checkpoint (its layout kept) as Megatron-LM's torch format."""
    located = locate_iteration(load, iteration)
    if located is None:
        raise GigatronError(f"--load {load}: no {TRACKER_FILENAME} there")
    iteration_dir, iteration, release = located
    final = save / iteration_dir.name
    if final.exists():
        raise GigatronError(f"--save {save}: already holds {final.name}; give a new directory")
    tmp = save / (final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(iteration_dir.glob(f"mp_rank_*/{CHECKPOINT_FILENAME}"))
    for path in files:
        state = safe_load(path)
        if not isinstance(state.get("args"), dict):
            raise GigatronError(f"{path}: not a gigatron checkpoint file")
        out: dict[str, Any] = {
            "args": megatron_args(state["args"], state),
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "num_floating_point_operations_so_far": state.get(
                "num_floating_point_operations_so_far", 0
            ),
        }
        for key in [k for k in state if k == "model" or k.startswith("model")]:
            model = {megatron_mtp_name(name): tensor for name, tensor in state[key].items()}
            if te_names:
                layers = {".".join(n.split(".")[:3]) for n in model if ".layers." in n}
                model = _te_model(model, layers)
            else:
                model = _local_model(model)
            out[key] = _sequential_experts(model, extra_states=True)
        target = tmp / path.parent.name / CHECKPOINT_FILENAME
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, target)
    os.replace(tmp, final)
    (save / TRACKER_FILENAME).write_text("release\n" if release else f"{iteration}\n")
    log(f"wrote {len(files)} Megatron-LM file(s) to {final} (model weights only)")
    return final


def gigatron_config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """gigatron configuration values from Megatron-LM's `args` (same names; plain values)."""

    values = vars(args)
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in FIELD_SECTION or not isinstance(value, (bool, int, float, str, list)):
            continue
        try:
            config_from_dict({name: value})
        except GigatronError:
            continue  # a value gigatron does not take (e.g. a choice it does not offer)
        out[name] = value
    if values.get("norm_epsilon") is not None:
        out["layernorm_epsilon"] = values["norm_epsilon"]
    if out.get("vocab_size") is None and values.get("padded_vocab_size"):
        out["padded_vocab_size"] = values["padded_vocab_size"]
    return config_as_dict(config_from_dict(out))


def _consumed(args: argparse.Namespace) -> dict[str, int]:
    """The samples Megatron's run had consumed (kept, so a resume continues the data order)."""
    keys = ("consumed_train_samples", "consumed_valid_samples")
    return {key: int(getattr(args, key, 0) or 0) for key in keys}


# The model flags a file without saved args must be given (the rest keep gigatron's defaults).
_SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads")


def args_from_flags(flags: list[str], path: Path) -> argparse.Namespace:
    """Megatron-LM's flat args for a file that saved none (older NGC downloads): the model
    flags given to `convert` (Megatron's names), each shape flag required."""
    given = {flag.split("=", 1)[0] for flag in flags}
    missing = [flag for flag in _SHAPE_FLAGS if flag not in given]
    if missing:
        raise GigatronError(
            f"{path}: saved no args, so its model flags must be given: pass "
            f"{', '.join(missing)} (and the other flags of the run that made it, e.g. "
            "--normalization, --swiglu, --num-query-groups)"
        )
    sections = config_as_dict(parse_config(flags, prog="gigatron convert", validate=False))
    return argparse.Namespace(
        **{
            k: v
            for section in sections.values()
            if isinstance(section, dict)
            for k, v in section.items()
        }
    )


def _megatron_state(path: Path, flags: list[str]) -> dict[str, Any]:
    """A Megatron-LM file in Megatron-Core's layout with its args (given by `flags` when it
    saved none); its padded vocabulary from the word embedding when the args lack it."""
    state = safe_load(path, mmap=True)
    if state.get("args") is None and "model" in state:
        state = dict(state, args=args_from_flags(flags, path))
    elif flags:
        raise GigatronError(f"{' '.join(flags)}: {path} saved its args; drop the model flags")
    if not isinstance(state.get("args"), argparse.Namespace):
        raise GigatronError(f"{path}: was not written by Megatron-LM (no argparse args)")
    state = core_state(state)  # a legacy model-class file: Megatron-Core's names
    args = state["args"]
    embedding = state["model"].get("embedding.word_embeddings.weight")
    if getattr(args, "padded_vocab_size", None) is None and embedding is not None:
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        args.padded_vocab_size = embedding.shape[0] * tp
    return state


def stage_megatron(
    located: tuple[Path, int, bool], staged: Path, family: str | None, flags: list[str] = ()
) -> Path:
    """Rewrite the Megatron-LM files of `located` in `staged` as a gigatron checkpoint of the
    same layout (gigatron's names and configuration; tensors memory-mapped); `flags`: the
    model flags of files that saved no args. Returns `staged`."""
    iteration_dir, iteration, release = located
    files = sorted(iteration_dir.glob(f"mp_rank_*/{CHECKPOINT_FILENAME}"))
    if not files and is_megatron_dist(iteration_dir):
        return _stage_megatron_dist(located, staged, family)
    if not files:
        raise GigatronError(f"{iteration_dir}: holds no mp_rank_*/{CHECKPOINT_FILENAME}")
    for path in files:
        state = _megatron_state(path, list(flags))
        out = {
            "args": gigatron_config_dict(state["args"]),
            "iteration": iteration,
            "checkpoint_version": 3.0,
            **_consumed(state["args"]),
        }
        if family is not None:
            out["gigatron_family"] = family  # --model-type: Megatron's files do not say
        for key in [k for k in state if k == "model" or k.startswith("model")]:
            out[key] = model_to_gigatron(state[key])
        target = staged / iteration_dir.name / path.parent.name / CHECKPOINT_FILENAME
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, target)
    (staged / TRACKER_FILENAME).write_text("release\n" if release else f"{iteration}\n")
    return staged


def _stage_megatron_dist(located: tuple[Path, int, bool], staged: Path, family: str | None):
    """Megatron's torch_dist iteration as one tp = pp = 1 gigatron file (whole tensors)."""
    iteration_dir, iteration, release = located
    saved = read_common(iteration_dir)["args"]
    args = gigatron_config_dict(saved)
    for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        args["parallel"][size] = 1  # the tensors are read whole
    args["parallel"]["expert_model_parallel_size"] = 1
    out = {"args": args, "iteration": iteration, "checkpoint_version": 3.0, **_consumed(saved)}
    if family is not None:
        out["gigatron_family"] = family
    out["model"] = full_model(iteration_dir)
    target = staged / iteration_dir.name / "mp_rank_00" / CHECKPOINT_FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, target)
    (staged / TRACKER_FILENAME).write_text("release\n" if release else f"{iteration}\n")
    return staged


def whole_to_megatron_dist(whole: Path, save: Path, log: Any = print) -> Path:
    """A tp = pp = 1 gigatron checkpoint `whole` as Megatron-LM's torch_dist (model weights;
    Megatron reshards it to any layout on load)."""
    iteration_dir, iteration, release = locate_iteration(whole, None)
    state = safe_load(iteration_dir / "mp_rank_00" / CHECKPOINT_FILENAME)
    args = megatron_args(state["args"], state)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    model = dict(state["model"])
    if not getattr(args, "untie_embeddings_and_output_weights", False):
        model.pop("output_layer.weight", None)  # tied: Megatron stores the embedding only
    common = {
        "args": args, "checkpoint_version": 3.0, "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }  # fmt: skip
    final = save / iteration_dir.name
    if final.exists():
        raise GigatronError(f"--save {save}: already holds {final.name}; give a new directory")
    tmp = save / (final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    save_megatron_dist(model, common, tmp)
    os.replace(tmp, final)
    (save / TRACKER_FILENAME).write_text("release\n" if release else f"{iteration}\n")
    log(f"wrote Megatron-LM's torch_dist checkpoint to {final} (model weights only)")
    return final
