"""A LoRA run's checkpoint (adapters only, docs/lora.md) out of gigatron.

`merge_lora`: the base (`--pretrained-checkpoint`, any format) with every adapted weight
replaced by W + (alpha / r) B A, written as a plain checkpoint at any layout through the
conversion pipeline (pipeline.py), one tensor at a time. `export_peft`: the adapters in Hugging
Face PEFT's layout (`adapter_config.json` + `adapter_model.safetensors`) for the Llama-shaped
model `gigatron convert --to hf` writes from the base (q/k/v, gate/up: one PEFT adapter each,
sharing A; their B rows are the fused B's rows)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gigatron.checkpoint.pipeline import FullModel, Log, Target, read_gigatron, write_gigatron
from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import split_qkv
from gigatron.models.lora import LoRASpec

A_SUFFIX, B_SUFFIX = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
M_SUFFIX = ".adapter.magnitude"  # DoRA's magnitude per output row (--lora-dora)
# gigatron's adapted layer -> the Llama modules PEFT adapts for it (Hugging Face names).
PEFT_MODULES = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@contextlib.contextmanager
def read_adapters(load: Path, iteration: int | None) -> Iterator[tuple[FullModel, LoRASpec]]:
    """A LoRA run's checkpoint and its adapters' spec (an error for any other checkpoint)."""
    with read_gigatron(load, iteration) as model:
        spec = LoRASpec.from_config(model.cfg)
        if spec is None:
            raise GigatronError(
                f"--load {load}: not a LoRA run's checkpoint (its configuration has no "
                "--lora-target-modules); give the --save directory of a LoRA run"
            )
        yield model, spec


def adapted_layers(names: Iterable[str]) -> list[str]:
    """The layers (e.g. decoder.layers.0.mlp.linear_fc1) whose adapters a checkpoint holds."""
    return [n[: -len(A_SUFFIX)] for n in names if n.endswith(A_SUFFIX)]


class MergedSource:
    """The base's full tensors with each adapted weight replaced by W + scale B A."""

    def __init__(self, base: Any, adapters: Any, scale: float) -> None:
        self.base, self.adapters, self.scale = base, adapters, scale
        self.layers = {f"{layer}.weight": layer for layer in adapted_layers(adapters.names())}
        missing = sorted(set(self.layers) - set(base.names()))
        if missing:
            raise GigatronError(
                f"--pretrained-checkpoint: holds no {', '.join(missing[:4])}, which the adapters "
                "adapt; give the base model the LoRA run trained on"
            )

    def names(self) -> list[str]:
        return self.base.names()

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def meta(self, name: str) -> torch.Tensor:
        return self.base.meta(name)

    def tensor(self, name: str) -> torch.Tensor:
        weight = self.base.tensor(name)
        layer = self.layers.get(name)
        if layer is None:
            return weight
        a = self.adapters.tensor(layer + A_SUFFIX).float()
        b = self.adapters.tensor(layer + B_SUFFIX).float()
        merged = weight.float() + self.scale * (b @ a)
        if layer + M_SUFFIX in self.adapters:  # DoRA: m V / ||V|| per output row
            magnitude = self.adapters.tensor(layer + M_SUFFIX).float()
            merged = merged * (magnitude / merged.norm(dim=1))[:, None]
        return merged.to(weight.dtype)

    def stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, self.tensor(name)) for name in self.names())


def base_directory(adapted: FullModel, base: str | None) -> Path:
    """--pretrained-checkpoint of the convert command, else the one the LoRA run trained on."""
    path = base or adapted.cfg.checkpoint.pretrained_checkpoint
    if not path or not Path(path).is_dir():
        raise GigatronError(
            f"--pretrained-checkpoint {path}: no such directory; give the base checkpoint the "
            "LoRA run trained on"
        )
    return Path(path)


def merge_lora(
    load: Path,
    save: Path,
    base: str | None = None,
    target: Target = Target(),
    log: Log = print,
    iteration: int | None = None,
) -> Path:
    """Write base + adapters as a plain gigatron checkpoint (model weights only)."""
    with read_adapters(load, iteration) as (adapted, spec):
        with read_gigatron(base_directory(adapted, base)) as base_model:
            log(f"merging the adapters of {adapted.where} into {base_model.where}")
            merged = FullModel(
                MergedSource(base_model.source, adapted.source, spec.scale),
                base_model.cfg,
                base_model.family,
                adapted.where,
                adapted.iteration,
                adapted.release,
                base_model.sizes,
                base_model.extra,
            )
            return write_gigatron(merged, save, target, log)


def _check_llama_shaped(cfg: Any, load: Path) -> None:
    m = cfg.model
    if not m.swiglu or m.multi_latent_attention or cfg.moe.num_experts:
        raise GigatronError(
            f"--load {load}: PEFT export maps adapters onto Llama-shaped models (SwiGLU MLP, "
            "q/k/v attention, no experts); merge it instead: gigatron convert --merge-lora"
        )


def peft_tensors(cfg: Any, source: Any) -> dict[str, torch.Tensor]:
    """PEFT's tensors (`base_model.model.<module>.lora_{A,B}.weight`, DoRA's
    `lora_magnitude_vector`) of every adapter: a fused layer's B rows (and magnitudes) split
    among the separate Hugging Face layers."""
    m = cfg.model
    heads = m.num_attention_heads
    groups = m.num_query_groups if m.group_query_attention else heads
    kv_channels = m.kv_channels or m.hidden_size // heads
    out = {}
    for layer in adapted_layers(source.names()):
        number, module = _LAYER.match(layer).groups()
        a, b = source.tensor(layer + A_SUFFIX), source.tensor(layer + B_SUFFIX)
        dora = layer + M_SUFFIX in source
        if dora:  # a column beside B: its rows split with B's
            b = torch.cat([b, source.tensor(layer + M_SUFFIX)[:, None].to(b.dtype)], dim=1)
        if module.endswith("linear_qkv"):
            rows = split_qkv(b, heads, groups, kv_channels)
        elif module.endswith("linear_fc1"):
            rows = b.chunk(2, dim=0)
        else:
            rows = (b,)
        for hf_module, b_rows in zip(PEFT_MODULES[module], rows, strict=True):
            prefix = f"base_model.model.model.layers.{number}.{hf_module}"
            out[f"{prefix}.lora_A.weight"] = a.clone().contiguous()
            out[f"{prefix}.lora_B.weight"] = b_rows[:, : a.shape[0]].clone().contiguous()
            if dora:
                out[f"{prefix}.lora_magnitude_vector"] = b_rows[:, -1].clone().contiguous()
    return out


def peft_config(spec: LoRASpec, base: str | None) -> dict[str, Any]:
    """adapter_config.json of PEFT's LoRA."""
    modules = sorted(
        {hf.rsplit(".", 1)[-1] for t in spec.targets for hf in PEFT_MODULES[_module_of(t)]}
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or "",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": spec.dora,
        "modules_to_save": None,
    }


def _module_of(target: str) -> str:
    return next(module for module in PEFT_MODULES if module.endswith(target))


def export_peft(load: Path, save: Path, log: Log = print, iteration: int | None = None) -> Path:
    """Write the adapters of a LoRA run's checkpoint as a PEFT adapter folder."""
    with read_adapters(load, iteration) as (adapted, spec):
        _check_llama_shaped(adapted.cfg, load)
        tensors = peft_tensors(adapted.cfg, adapted.source)
        save.mkdir(parents=True, exist_ok=True)
        partial = save / f".{ADAPTER_WEIGHTS}.tmp"
        save_file(tensors, str(partial), metadata={"format": "pt"})
        os.replace(partial, save / ADAPTER_WEIGHTS)
        config = peft_config(spec, adapted.cfg.checkpoint.pretrained_checkpoint)
        (save / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    log(f"wrote {len(tensors)} adapter tensors of {adapted.where} to {save} (PEFT LoRA)")
    return save
