"""Export of a quantized Llama checkpoint in TensorRT-LLM's checkpoint layout (`--export-format
trtllm`): `config.json` (TensorRT-LLM's PretrainedConfig fields, `quantization`) and
`rank0.safetensors` (one rank: tp = pp = 1) under TensorRT-LLM's names, with q, k and v fused
into one `attention.qkv` weight ([q rows; k rows; v rows]) and gate/up as `mlp.fc` / `mlp.gate`.

`fp8-tensor` is TensorRT-LLM's FP8 (per-tensor e4m3 weights and static input scales): each
linear weight is stored as float8_e4m3fn with `weights_scaling_factor` and
`activation_scaling_factor` ([1], float32); gigatron's fused linear_qkv has one weight scale and
one input scale, which is what TensorRT-LLM's fused qkv takes. Every other method is written as
its fake-quantized weights in the checkpoint's precision (`quant_algo` null): TensorRT-LLM's own
int4/int8 weight-only storage comes from its CUDA preprocessing, run by `trtllm-build`.
The tensors come from gigatron's Hugging Face export (checkpoint/hf_convert.py), whose q/k/v and
gate/up split undoes Megatron's interleaved fused layouts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.hf_convert import gigatron_to_hf
from gigatron.checkpoint.safetensors_io import SafetensorsFolder
from gigatron.errors import GigatronError
from gigatron.models.activation_quant import E4M3_MAX
from gigatron.quantize.checkpoint import check_new_directory, read_packed

# TensorRT-LLM linear -> (the Hugging Face Llama modules fused into it, gigatron's layer).
LINEARS = {
    "attention.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "self_attention.linear_qkv"),
    "attention.dense": (("self_attn.o_proj",), "self_attention.linear_proj"),
    "mlp.fc": (("mlp.gate_proj",), "mlp.linear_fc1"),  # TensorRT-LLM applies the act to fc
    "mlp.gate": (("mlp.up_proj",), "mlp.linear_fc1"),
    "mlp.proj": (("mlp.down_proj",), "mlp.linear_fc2"),
}  # fmt: skip
NORMS = {"input_layernorm": "input_layernorm", "post_layernorm": "post_attention_layernorm"}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def trtllm_config(hf: dict[str, Any], dtype: str, quant_algo: str | None) -> dict[str, Any]:
    """TensorRT-LLM's config.json of a Hugging Face Llama config."""
    heads = hf["num_attention_heads"]
    return {
        "architecture": "LlamaForCausalLM", "dtype": dtype, "logits_dtype": "float32",
        "vocab_size": hf["vocab_size"], "max_position_embeddings": hf["max_position_embeddings"],
        "hidden_size": hf["hidden_size"], "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads, "num_key_value_heads": hf.get("num_key_value_heads", heads),
        "head_size": hf.get("head_dim") or hf["hidden_size"] // heads,
        "hidden_act": hf["hidden_act"], "intermediate_size": hf["intermediate_size"],
        "norm_epsilon": hf["rms_norm_eps"], "position_embedding_type": "rope_gpt_neox",
        "rotary_base": hf.get("rope_theta", 10000.0), "rotary_scaling": hf.get("rope_scaling"),
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None,
                         "exclude_modules": ["lm_head"] if quant_algo else None},
        "use_parallel_embedding": False, "embedding_sharding_dim": 0,
        "share_embedding_table": bool(hf.get("tie_word_embeddings", False)),
    }  # fmt: skip


def trtllm_tensors(
    folder: SafetensorsFolder, layers: int, packed: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """TensorRT-LLM's tensors of a Hugging Face Llama folder; `packed` (fp8): the quantized
    checkpoint's scales, each linear weight stored as e4m3."""
    out = {"transformer.vocab_embedding.weight": folder.tensor("model.embed_tokens.weight"),
           "transformer.ln_f.weight": folder.tensor("model.norm.weight")}  # fmt: skip
    head = "lm_head.weight" if "lm_head.weight" in folder else "model.embed_tokens.weight"
    out["lm_head.weight"] = folder.tensor(head)
    for i in range(layers):
        ours, theirs = f"transformer.layers.{i}", f"model.layers.{i}"
        for name, source in NORMS.items():
            out[f"{ours}.{name}.weight"] = folder.tensor(f"{theirs}.{source}.weight")
        for name, (modules, layer) in LINEARS.items():
            weight = torch.cat([folder.tensor(f"{theirs}.{m}.weight") for m in modules])
            if packed is None:
                out[f"{ours}.{name}.weight"] = weight
                continue
            scale = packed[f"decoder.layers.{i}.{layer}.weight_scale"].reshape(1).float()
            codes = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
            out[f"{ours}.{name}.weight"] = codes.to(torch.float8_e4m3fn)
            out[f"{ours}.{name}.weights_scaling_factor"] = scale.clone()
            inputs = packed[f"decoder.layers.{i}.{layer}.input_scale"].reshape(1).float()
            out[f"{ours}.{name}.activation_scaling_factor"] = inputs.clone()
    return {name: tensor.contiguous() for name, tensor in out.items()}


def export_trtllm(load: str | Path, save: str | Path, log: Any = print) -> Path:
    """Write the TensorRT-LLM checkpoint of the quantized Llama checkpoint `load`."""
    from safetensors.torch import save_file  # why: keep `gigatron quantize --help` fast

    load, save = Path(load), Path(save)
    check_new_directory("--hf-save", save)
    packed, info = read_packed(load)
    if info["method"] == "fp8-channel":
        raise GigatronError(
            "--export-format trtllm: --method fp8-channel has static per-tensor input scales, "
            "which TensorRT-LLM's per-channel FP8 (dynamic per-token inputs) does not take; "
            "quantize with fp8-tensor (TensorRT-LLM's FP8)"
        )
    fp8 = info["method"] == "fp8-tensor"
    tmp = save.parent / f".{save.name}.tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        gigatron_to_hf(load, tmp / "hf", log=lambda _: None, tokenizer_mode="none")
        hf = json.loads((tmp / "hf" / "config.json").read_text())
        if hf.get("model_type") != "llama":
            raise GigatronError(
                f"--load {load}: a '{hf.get('model_type')}' model; --export-format trtllm "
                "writes Llama models (TensorRT-LLM's LlamaForCausalLM)"
            )
        with SafetensorsFolder(tmp / "hf") as folder:
            tensors = trtllm_tensors(folder, hf["num_hidden_layers"], packed if fp8 else None)
        dtype = DTYPES[tensors["transformer.ln_f.weight"].dtype]
        (tmp / "out").mkdir()
        save_file(tensors, str(tmp / "out" / "rank0.safetensors"))
        config = trtllm_config(hf, dtype, "FP8" if fp8 else None)
        (tmp / "out" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp / "out", save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported {load} ({info['method']}) as a TensorRT-LLM checkpoint to {save}")
    return save
