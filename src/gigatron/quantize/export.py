"""Export of a quantized checkpoint as a Hugging Face folder in the compressed-tensors format
(transformers and vLLM read it): weight-only "pack-quantized" (int8: four codes per int32, int4:
eight), one scale per group; W8A8 (SmoothQuant) "int-quantized" (int8 tensors), one scale per
row, inputs quantized per token at run time; fp8 "float-quantized" (e4m3 tensors), one scale
per row or tensor, a static input scale per layer; with an fp8 KV cache, each attention's static
key and value scales (`self_attn.k_scale`, `v_scale`, [1]) and `kv_cache_scheme`, as vLLM reads
them; `quantization_config` in config.json, sharded safetensors.

The gigatron export (checkpoint/hf_convert.py) writes the fake-quantized weights under Hugging
Face's names, and once more a checkpoint whose linear weights are their scales repeated over each
group, so that the scales follow Hugging Face's renaming and splits (QKV, gate/up) exactly;
compressed-tensors then compresses (codes = weight / scale, integers) and describes them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.hf_convert import gigatron_to_hf
from gigatron.checkpoint.pipeline import Target, read_gigatron, write_gigatron
from gigatron.checkpoint.safetensors_io import SafetensorsFolder
from gigatron.errors import GigatronError
from gigatron.quantize.checkpoint import MappedSource, check_new_directory, read_packed
from gigatron.quantize.rtn import quantized_layer

MODEL_TYPES = ("llama", "mistral", "qwen2")  # Llama-style: every linear layer an nn.Linear
WEIGHT_ONLY_FORMAT = "pack-quantized"  # vLLM reads weight-only ints so
W8A8_FORMAT = "int-quantized"  # int8 codes as int8 tensors (vLLM's W8A8 kernels)
FP8_FORMAT = "float-quantized"  # e4m3 codes as float8_e4m3fn tensors
# The Llama modules each gigatron linear layer becomes (by its name in a transformer layer).
HF_MODULES = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_ATTENTION = re.compile(r"decoder\.layers\.(\d+)\.self_attention\.core_attention")
WEIGHT_FILES = (".safetensors", ".safetensors.index.json")


def require_export_libraries() -> None:
    """Refuse the export, before anything is written, when its libraries are missing."""
    missing = [n for n in ("compressed_tensors", "transformers") if not importlib.util.find_spec(n)]
    if missing:
        raise GigatronError(
            f"--hf-save: needs {' and '.join(missing)}, not installed; "
            "pip install 'gigatron[quantize]'"
        )


def kv_cache_scales(info: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """Each layer's (key scale, value scale) of the checkpoint's fp8 KV cache ({}: none)."""
    scales = {}
    for name, (key, value) in info.get("kv_cache_scales", {}).items():
        match = _ATTENTION.fullmatch(name)
        if match is None:
            raise GigatronError(
                f"{name}: fp8 KV-cache scales of an attention the export does not know (it takes "
                "decoder.layers.N.self_attention.core_attention); quantize without "
                "--kv-cache-dtype to export"
            )
        scales[int(match.group(1))] = (float(key), float(value))
    return scales


def _kv_cache_scheme() -> Any:
    """compressed-tensors' description of a static per-tensor e4m3 KV cache (vLLM's fp8 one)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor",
                            dynamic=False)  # fmt: skip


def _set_kv_cache_scales(model: torch.nn.Module, scales: dict[int, tuple[float, float]]) -> None:
    """`k_scale` and `v_scale` ([1], the attention's dtype) on each layer's self_attn, saved
    with the weights (what vLLM loads into its fp8 cache)."""
    for index, (key, value) in scales.items():
        attention = model.model.layers[index].self_attn
        dtype = attention.o_proj.weight.dtype
        for name, scale in (("k_scale", key), ("v_scale", value)):
            tensor = torch.tensor([scale], dtype=dtype)
            attention.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


def _add_kv_cache_scheme(out: Path) -> None:
    """config.json's quantization_config gets the KV cache's scheme (its scales are tensors)."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    scheme = _kv_cache_scheme().model_dump(mode="json", exclude_none=True)
    config["quantization_config"]["kv_cache_scheme"] = scheme
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _scheme(info: dict[str, Any]) -> Any:
    # why: compressed-tensors is an optional dependency, needed by the export only
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    bits, group_size, activations = info["bits"], info["group_size"], None
    if info.get("number") == "float":  # fp8: per-channel or per-tensor weights, static inputs
        weights = QuantizationArgs(num_bits=bits, type="float", symmetric=True,
                                   strategy=info["weight_scales"])  # fmt: skip
        activations = QuantizationArgs(num_bits=info["activation_bits"], type="float",
                                       symmetric=True, strategy="tensor", dynamic=False)  # fmt: skip
    elif info.get("activation_bits"):  # W8A8: per-channel weights, per-token dynamic inputs
        weights = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")
        activations = QuantizationArgs(num_bits=info["activation_bits"], type="int",
                                       symmetric=True, strategy="token", dynamic=True)  # fmt: skip
    else:
        weights = QuantizationArgs(
            num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group_size
        )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])


def scales_folder(load: Path, tmp: Path) -> Path:
    """A Hugging Face folder whose quantized weights hold their scales, repeated over each
    group or row (in the checkpoint's precision)."""
    packed, _ = read_packed(load)

    def expanded(name: str, tensor: torch.Tensor) -> torch.Tensor:
        layer = quantized_layer(name)
        if layer is None:
            return tensor
        scales = packed[f"{layer}.weight_scale"]
        scales = scales.repeat_interleave(tensor.shape[0] // scales.shape[0], dim=0)
        scales = scales.repeat_interleave(tensor.shape[1] // scales.shape[1], dim=1)
        return scales.to(tensor.dtype)

    with read_gigatron(load) as model:
        scaled = dataclasses.replace(model, source=MappedSource(model.source, expanded))
        write_gigatron(scaled, tmp / "scales-ckpt", Target(), lambda _: None)
    gigatron_to_hf(tmp / "scales-ckpt", tmp / "scales-hf", log=lambda _: None,
                   tokenizer_mode="none")  # fmt: skip
    return tmp / "scales-hf"


def _set_scales(model: torch.nn.Module, scales_folder: Path, integer: bool) -> None:
    """Each quantized linear layer's scales (per group, row or tensor), from `scales_folder`;
    integer codes: refused when the weight is not its codes times them (a precision the export
    cannot keep)."""
    with SafetensorsFolder(scales_folder) as folder:
        for name, module in model.named_modules():
            if not (isinstance(module, torch.nn.Linear) and hasattr(module, "weight_scale")):
                continue
            shape = module.weight_scale.shape
            rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, 1)
            full = folder.tensor(f"{name}.weight").to(torch.float32)
            scales = full[:: full.shape[0] // rows, :: full.shape[1] // cols]
            module.weight_scale.data = scales.reshape(shape).to(module.weight_scale.dtype)
            if not integer:
                continue
            ratio = module.weight.detach().float() / full
            if (ratio - ratio.round()).abs().nan_to_num(0.0).max() > 0.05:
                raise GigatronError(
                    f"{name}: its weights are not integer multiples of its scales in the "
                    "checkpoint's precision; export a float32 checkpoint"
                )


def _set_input_scales(model: torch.nn.Module, packed: dict[str, torch.Tensor]) -> None:
    """Each fp8 layer's static input scale on the Hugging Face modules it became (q/k/v share
    linear_qkv's input, gate/up linear_fc1's)."""
    modules = dict(model.named_modules())
    for key, scale in packed.items():
        layer = key.removesuffix(".input_scale")
        if layer == key:
            continue
        match = _LAYER.fullmatch(layer)
        targets = HF_MODULES.get(match.group(2)) if match else None
        if targets is None:
            raise GigatronError(
                f"{layer}: no Llama module of this name; the fp8 export takes the attention "
                "and dense MLP layers of Llama-style models"
            )
        for target in targets:
            module = modules[f"model.layers.{match.group(1)}.{target}"]
            value = scale.reshape(module.input_scale.shape).to(module.input_scale.dtype)
            module.input_scale.data = value.clone()  # a tensor each: shared ones are refused


def _compress(
    load: Path, plain: Path, scales: Path, out: Path, info: dict, shard: int | None
) -> None:
    # why: transformers and compressed-tensors are heavy optional dependencies
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(plain, dtype="auto").eval()
    # why not compressed-tensors' kv_cache_scheme here: whether it hooks transformers' attention
    # depends on both libraries' versions; the scales are set and described by hand instead
    apply_quantization_config(model, _scheme(info), show_progress=False)
    _set_scales(model, scales, integer=info.get("number", "int") == "int")
    kv_scales = kv_cache_scales(info)
    _set_kv_cache_scales(model, kv_scales)
    if info.get("number") == "float":
        _set_input_scales(model, read_packed(load)[0])
        form = FP8_FORMAT
    else:
        form = W8A8_FORMAT if info.get("activation_bits") else WEIGHT_ONLY_FORMAT
    compressor = ModelCompressor.from_pretrained_model(model, form)
    compressor.compress_model(model)
    model.save_pretrained(out, max_shard_size=shard or "5GB")
    compressor.update_config(str(out))
    if kv_scales:
        _add_kv_cache_scheme(out)


def export_compressed(
    load: str | Path, save: str | Path, max_shard_bytes: int | None = None, log: Any = print
) -> Path:
    """Write the Hugging Face compressed-tensors folder of the quantized checkpoint `load`."""
    load, save = Path(load), Path(save)
    check_new_directory("--hf-save", save)
    require_export_libraries()
    _, info = read_packed(load)
    tmp = save.parent / f".{save.name}.tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        gigatron_to_hf(load, tmp / "plain", log=lambda _: None)
        model_type = json.loads((tmp / "plain" / "config.json").read_text()).get("model_type")
        if model_type not in MODEL_TYPES:
            raise GigatronError(
                f"--load {load}: a '{model_type}' model; the compressed-tensors export takes "
                f"{', '.join(MODEL_TYPES)} models (linear layers as nn.Linear)"
            )
        scales = scales_folder(load, tmp)
        _compress(load, tmp / "plain", scales, tmp / "out", info, max_shard_bytes)
        for extra in (tmp / "plain").iterdir():  # tokenizer files
            if not extra.name.endswith(WEIGHT_FILES) and extra.name != "config.json":
                shutil.copy2(extra, tmp / "out" / extra.name)
        os.replace(tmp / "out", save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported {load} ({info['method']}) to {save}")
    return save
