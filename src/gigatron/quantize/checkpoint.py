"""Weight-only post-training quantization of a gigatron checkpoint.

The output (`--save`) is a gigatron checkpoint in the source's layout whose linear weights are the quantized ones
dequantized (so `evaluate`, `generate`, `serve` and `convert` run the fake-quantized model
unchanged), with `quantization` (method, bits, group size, layers) in its header, plus
`quantized.safetensors`: the integer codes (int4: two per byte) and scales of every quantized
layer. It appears whole or not at all (written aside, then renamed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.pipeline import Target, read_gigatron, write_gigatron
from gigatron.errors import GigatronError
from gigatron.models.activation_quant import is_grouped_experts
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.calibration import calibrate
from gigatron.quantize.folding import Calibrated
from gigatron.quantize.methods import METHODS, Method
from gigatron.quantize.rtn import (
    check_shape,
    dequantize,
    pack_int4,
    quantize_weight,
    quantized_layer,
)

PACKED_FILENAME = "quantized.safetensors"
FAMILIES = ("gpt", "mamba")  # `linear_*` layers, and Mamba mixers' in_proj / out_proj


class MappedSource:
    """A conversion source whose tensors come out through `transform(name, tensor)`."""

    def __init__(self, source: Any, transform: Callable[[str, torch.Tensor], torch.Tensor]):
        self.source, self.transform = source, transform

    def names(self) -> list[str]:
        return self.source.names()

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def meta(self, name: str) -> torch.Tensor:
        return self.source.meta(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.transform(name, self.source.tensor(name))

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, self.transform(name, t)) for name, t in self.source.stream())


class Quantizer:
    """Quantizes each linear weight (round-to-nearest, or the codes and scales a calibration
    computed, by layer, in `calibrated`), keeps its codes and scales in `packed` and returns it
    dequantized; a tensor the calibration changed (AWQ's folded norms) comes out changed."""

    def __init__(
        self, method: Method, group_size: int | None, calibrated: Calibrated | None = None
    ) -> None:
        self.method, self.group_size = method, group_size
        self.calibrated = calibrated or Calibrated(layers={})
        self.packed: dict[str, torch.Tensor] = dict(self.calibrated.extra)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.calibrated.replaced:
            return self.calibrated.replaced[name].to(tensor.dtype)
        layer = quantized_layer(name)
        if layer is None:
            return tensor
        codes, scales = self.calibrated.layers.get(layer) or quantize_weight(
            tensor, self.method, self.group_size or tensor.shape[1]
        )
        stored = pack_int4(codes) if self.method.bits == 4 else codes
        self.packed[f"{layer}.weight_packed"] = stored.contiguous()
        self.packed[f"{layer}.weight_scale"] = scales.contiguous()
        return dequantize(codes, scales, tensor.dtype)


def plan_layers(
    source: Any, method: Method, group_size: int | None, calibrating: bool = False
) -> list[str]:
    """The layers to quantize, each shape checked before anything is written (group size None:
    one scale per output row)."""
    layers = []
    for name in source.names():
        layer = quantized_layer(name)
        if layer is not None:
            shape = tuple(source.meta(name).shape)
            check_shape(layer, shape, group_size or shape[-1], method, calibrating)
            layers.append(layer)
    return layers


def resolve_group_size(method: Method, group_size: int | None) -> int | None:
    """The group size of a method (None: one scale per output row); --group-size defaults to
    128 and is refused by per-channel methods."""
    if method.per_channel:
        if group_size is not None:
            raise GigatronError(
                f"--group-size {group_size}: --method {method.name} has one weight scale per "
                "output row; drop --group-size"
            )
        return None
    group_size = 128 if group_size is None else group_size
    if group_size < 1:
        raise GigatronError(f"--group-size {group_size}: must be at least 1; e.g. 128")
    return group_size


def check_new_directory(flag: str, path: str | Path) -> None:
    """Refuse an output directory that holds something already."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise GigatronError(f"{flag} {path}: already exists and is not empty; give a new directory")


def quantize_checkpoint(
    load: str | Path,
    save: str | Path,
    method_name: str,
    group_size: int | None = None,
    iteration: int | None = None,
    log: Any = print,
    calibration: dict[str, Any] | None = None,
    pctx: ParallelContext | None = None,
) -> Path:
    """Quantize `load`'s checkpoint into the new directory `save`; returns `save`.
    `calibration` (data, size, seed): GPTQ (or the method's own calibration, AWQ) on that
    data, else round-to-nearest. Under torchrun (`pctx`) the processes share the calibration
    (the samples over data-parallel copies, each copy's model over tp x pp processes) and the
    first one writes `save`."""
    method = METHODS[method_name]
    group_size = resolve_group_size(method, group_size)
    save = Path(save)
    check_new_directory("--save", save)
    with read_gigatron(Path(load), iteration) as model:
        if model.family not in FAMILIES:
            raise GigatronError(
                f"--load {load}: a '{model.family}' model; --method {method.name} quantizes the "
                f"linear layers of {', '.join(FAMILIES)} models only"
            )
        layers = plan_layers(model.source, method, group_size, calibration is not None)
        if not layers:
            raise GigatronError(f"--load {load}: the model has no linear layers to quantize")
        if method.calibration and not calibration:
            raise GigatronError(
                f"--method {method.name}: calibrates on text; give --calib-data (and --calib-size)"
            )
        calibrated = None
        if calibration:
            calibrated = calibrate(model, method, group_size, **calibration, pctx=pctx)
        if pctx is not None and pctx.rank != 0:
            return save
        info = _header(method, group_size, calibration, layers, calibrated)
        quantizer = Quantizer(method, group_size, calibrated)
        source = MappedSource(model.source, quantizer)
        quantized = dataclasses.replace(model, source=source,
                                        extra={**model.extra, "quantization": info})  # fmt: skip
        tmp = save.parent / f".{save.name}.tmp-quantize"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            write_gigatron(quantized, tmp, Target(), lambda _: None)  # its paths are tmp's
            _save_packed(quantizer.packed, tmp / PACKED_FILENAME, info)
            os.replace(tmp, save)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    groups = f"group size {group_size}" if group_size else f"per {method.weight_scales}"
    log(
        f"quantized {len(layers)} linear layers ({method.name}, {info['algorithm']}, {groups}) to {save}"
    )
    return save


def _header(
    method: Method, group_size: int | None, calibration: dict[str, Any] | None,
    layers: list[str], calibrated: Calibrated | None,
) -> dict[str, Any]:  # fmt: skip
    """The `quantization` entry of the checkpoint's header (and of quantized.safetensors)."""
    info = {"method": method.name, "bits": method.bits, "group_size": group_size,
            "algorithm": (method.calibration or "gptq") if calibration else "rtn",
            "activation_bits": method.activation_bits, "number": method.number,
            "weight_scales": method.weight_scales, **(calibration or {}), "layers": layers}  # fmt: skip
    extra = calibrated.extra if calibrated else {}
    if method.number == "float":  # static input scales, read at load time
        info["input_scales"] = {  # grouped experts: one per expert
            layer: (extra[f"{layer}.input_scale"].tolist() if is_grouped_experts(layer)
                    else extra[f"{layer}.input_scale"].item())
            for layer in layers
        }  # fmt: skip
    if calibrated and calibrated.kv_cache:  # static fp8 KV-cache scales, read at load time
        info["kv_cache_scales"] = calibrated.kv_cache
    return info


def _save_packed(packed: dict[str, torch.Tensor], path: Path, info: dict[str, Any]) -> None:
    from safetensors.torch import save_file  # why: keep `gigatron quantize --help` fast

    metadata = {key: json.dumps(value) for key, value in info.items()}
    save_file(packed, str(path), metadata=metadata)


def read_packed(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(codes and scales by name, the quantization info) of a quantized checkpoint directory."""
    from safetensors import safe_open  # why: keep `gigatron quantize --help` fast

    with safe_open(str(Path(directory) / PACKED_FILENAME), framework="pt") as handle:
        info = {key: json.loads(value) for key, value in handle.metadata().items()}
        return {name: handle.get_tensor(name) for name in handle.keys()}, info
