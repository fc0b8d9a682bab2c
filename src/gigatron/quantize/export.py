"""Export of a quantized checkpoint as a Hugging Face folder in the compressed-tensors format
(transformers and vLLM read it): int8 as "int-quantized" (int8 weights), int4 as
"pack-quantized" (eight codes per int32), one scale per group, `quantization_config` in
config.json, sharded safetensors.

The gigatron export (checkpoint/hf_convert.py) writes the fake-quantized weights under Hugging
Face's names; each linear weight's codes and scales are then re-derived from them (lossless: see
rtn.py) and compressed-tensors compresses and describes them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.hf_convert import gigatron_to_hf
from gigatron.errors import GigatronError
from gigatron.quantize.checkpoint import check_new_directory, read_packed
from gigatron.quantize.methods import METHODS
from gigatron.quantize.rtn import quantize_weight

MODEL_TYPES = ("llama", "mistral", "qwen2")  # Llama-style: every linear layer an nn.Linear
FORMATS = {8: "int-quantized", 4: "pack-quantized"}
WEIGHT_FILES = (".safetensors", ".safetensors.index.json")


def require_export_libraries() -> None:
    """Refuse the export, before anything is written, when its libraries are missing."""
    missing = [n for n in ("compressed_tensors", "transformers") if not importlib.util.find_spec(n)]
    if missing:
        raise GigatronError(
            f"--hf-save: needs {' and '.join(missing)}, not installed; "
            "pip install 'gigatron[quantize]'"
        )


def _scheme(bits: int, group_size: int) -> Any:
    # why: compressed-tensors is an optional dependency, needed by the export only
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    weights = QuantizationArgs(
        num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group_size
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])


def _set_scales(model: torch.nn.Module, bits: int, group_size: int) -> int:
    """Each quantized linear layer's scales, re-derived from its (dequantized) weight."""
    method = next(m for m in METHODS.values() if m.bits == bits)
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, "weight_scale"):
            _, scales = quantize_weight(module.weight, method, group_size)
            module.weight_scale.data = scales.to(module.weight_scale.dtype)
            count += 1
    return count


def _compress(plain: Path, out: Path, bits: int, group_size: int, shard: int | None) -> None:
    # why: transformers and compressed-tensors are heavy optional dependencies
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(plain, dtype="auto").eval()
    apply_quantization_config(model, _scheme(bits, group_size), show_progress=False)
    _set_scales(model, bits, group_size)
    compressor = ModelCompressor.from_pretrained_model(model, FORMATS[bits])
    compressor.compress_model(model)
    model.save_pretrained(out, max_shard_size=shard or "5GB")
    compressor.update_config(str(out))


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
        _compress(tmp / "plain", tmp / "out", info["bits"], info["group_size"], max_shard_bytes)
        for extra in (tmp / "plain").iterdir():  # tokenizer files
            if not extra.name.endswith(WEIGHT_FILES) and extra.name != "config.json":
                shutil.copy2(extra, tmp / "out" / extra.name)
        os.replace(tmp / "out", save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported {load} ({info['method']}, group size {info['group_size']}) to {save}")
    return save
