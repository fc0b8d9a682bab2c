"""Export of a quantized Llama checkpoint in TensorRT-LLM's checkpoint layout (`--export-format
trtllm`): `config.json` (TensorRT-LLM's PretrainedConfig fields, `quantization`) and
`rank0.safetensors` (one rank: tp = pp = 1) under TensorRT-LLM's names, with q, k and v fused
into one `attention.qkv` weight ([q rows; k rows; v rows]) and gate/up as `mlp.fc` / `mlp.gate`.

`fp8-tensor` is TensorRT-LLM's FP8 (per-tensor e4m3 weights and static input scales): each
linear weight is stored as float8_e4m3fn with `weights_scaling_factor` and
`activation_scaling_factor` ([1], float32); gigatron's fused linear_qkv has one weight scale and
one input scale, which is what TensorRT-LLM's fused qkv takes. `int4-weight` and `int4-awq`
are its W4A16_AWQ in NVIDIA Model Optimizer's layout (packed int4 codes, per-group scales, unit
pre-quant scales: `int4_linear`), which `trtllm-build` rearranges for its kernels;
`int8-smoothquant` is its per-channel, per-token SmoothQuant (`smoothquant_linear`).
`int8-weight` is written as its fake-quantized weights in the checkpoint's precision
(`quant_algo` null): TensorRT-LLM's W8A16 layer holds int8 weights [in, out] already rearranged
for the GPU by its own operator (`trtllm-build` keeps int8 weights as given, and re-quantizes
float ones with max |w| / 128 per output feature, another grid than gigatron's max |w| / 127),
with `per_channel_scale` [out] in the model's dtype (docs/quantization.md).
With an fp8 KV cache (`--kv-cache-dtype fp8`): `kv_cache_quant_algo` FP8 and each layer's
`attention.kv_cache_scaling_factor` ([1], float32), one scale for keys and values, the larger of
gigatron's two (TensorRT-LLM's cache has one per layer).
The tensors come from gigatron's Hugging Face export (checkpoint/hf_convert.py), whose q/k/v and
gate/up split undoes Megatron's interleaved fused layouts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.hf_convert import gigatron_to_hf
from gigatron.checkpoint.safetensors_io import SafetensorsFolder
from gigatron.errors import GigatronError
from gigatron.models.activation_quant import E4M3_MAX
from gigatron.quantize.checkpoint import check_new_directory, read_packed
from gigatron.quantize.export import kv_cache_scales, scales_folder
from gigatron.quantize.rtn import pack_int4

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
# gigatron's methods TensorRT-LLM stores quantized, and its name of each (quant_algo).
SMOOTHQUANT = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
ALGORITHMS = {"fp8-tensor": "FP8", "int4-weight": "W4A16_AWQ", "int4-awq": "W4A16_AWQ",
              "int8-smoothquant": SMOOTHQUANT}  # fmt: skip
INT4_FIELDS = {"has_zero_point": False, "pre_quant_scale": True}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def trtllm_config(
    hf: dict[str, Any], dtype: str, quant_algo: str | None, group_size: int | None = None,
    kv_cache_quant_algo: str | None = None,
) -> dict[str, Any]:  # fmt: skip
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
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo,
                         "exclude_modules": ["lm_head"] if quant_algo else None,
                         **(INT4_FIELDS | {"group_size": group_size}
                            if quant_algo == "W4A16_AWQ" else {})},
        "use_parallel_embedding": False, "embedding_sharding_dim": 0,
        "share_embedding_table": bool(hf.get("tie_word_embeddings", False)),
    }  # fmt: skip


def trtllm_tensors(
    folder: SafetensorsFolder, layers: int, quantize: Callable[..., dict] | None = None
) -> dict[str, torch.Tensor]:
    """TensorRT-LLM's tensors of a Hugging Face Llama folder; `quantize(layer, names, weight)`
    (gigatron's layer, the Hugging Face weights fused into it, their fused weight): the tensors
    of a quantized linear, by suffix (`weight`, its scales)."""
    out = {"transformer.vocab_embedding.weight": folder.tensor("model.embed_tokens.weight"),
           "transformer.ln_f.weight": folder.tensor("model.norm.weight")}  # fmt: skip
    head = "lm_head.weight" if "lm_head.weight" in folder else "model.embed_tokens.weight"
    out["lm_head.weight"] = folder.tensor(head)
    for i in range(layers):
        ours, theirs = f"transformer.layers.{i}", f"model.layers.{i}"
        for name, source in NORMS.items():
            out[f"{ours}.{name}.weight"] = folder.tensor(f"{theirs}.{source}.weight")
        for name, (modules, layer) in LINEARS.items():
            names = [f"{theirs}.{m}.weight" for m in modules]
            weight = torch.cat([folder.tensor(n) for n in names])
            parts = {"weight": weight}
            if quantize is not None:
                parts = quantize(f"decoder.layers.{i}.{layer}", names, weight)
            out.update({f"{ours}.{name}.{key}": value for key, value in parts.items()})
    return {name: tensor.contiguous() for name, tensor in out.items()}


def fp8_linear(packed: dict[str, torch.Tensor], layer: str, weight: torch.Tensor) -> dict:
    """TensorRT-LLM's FP8 linear: e4m3 weight, per-tensor weight and input scales ([1])."""
    scale = packed[f"{layer}.weight_scale"].reshape(1).float()
    codes = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    inputs = packed[f"{layer}.input_scale"].reshape(1).float()
    return {"weight": codes.to(torch.float8_e4m3fn), "weights_scaling_factor": scale.clone(),
            "activation_scaling_factor": inputs.clone()}  # fmt: skip


def integer_codes(
    scales: SafetensorsFolder, layer: str, names: list[str], weight: torch.Tensor, high: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, each weight's scale) of a fused weight whose Hugging Face parts are `names`."""
    full = torch.cat([scales.tensor(n) for n in names]).float()  # each weight's, per element
    codes = torch.round(weight.float() / torch.where(full == 0, 1.0, full))
    exact = torch.equal((codes * full).to(weight.dtype), weight)
    if not exact or codes.abs().max() > high + 1:
        raise GigatronError(
            f"{layer}: its weights are not integer codes times their scales in the checkpoint's "
            "precision; export a float32 checkpoint"
        )
    return codes.to(torch.int8), full


def int4_linear(
    scales: SafetensorsFolder, group: int, layer: str, names: list[str], weight: torch.Tensor
) -> dict:
    """TensorRT-LLM's W4A16_AWQ linear (Model Optimizer's layout, which trtllm-build packs for
    its kernels): `weight` int8 [out / 2, in], the codes of output rows 2j (low nibble) and
    2j + 1 (high nibble) in one byte; `weights_scaling_factor` [out, in / group];
    `prequant_scaling_factor` [in], ones (gigatron folds AWQ's scales into the norms)."""
    codes, full = integer_codes(scales, layer, names, weight, 7)
    packed = pack_int4(codes.T).T.contiguous().view(torch.int8)
    factor = full[:, ::group].to(weight.dtype)
    return {"weight": packed, "weights_scaling_factor": factor.contiguous(),
            "prequant_scaling_factor": torch.ones(weight.shape[1], dtype=weight.dtype)}  # fmt: skip


def smoothquant_linear(
    scales: SafetensorsFolder, layer: str, names: list[str], weight: torch.Tensor
) -> dict:
    """TensorRT-LLM's per-channel, per-token SmoothQuant linear (its Llama converter's layout):
    `weight` int8 [out, in], `per_channel_scale` [1, out] float32 and, for the layers whose input
    is not a norm's (dense, proj), `smoother` [1, in] float32: ones (gigatron's smoothing scales
    are folded into the norms and fc1's up rows, linear_proj's are 1)."""
    codes, full = integer_codes(scales, layer, names, weight, 127)
    out = {"weight": codes, "per_channel_scale": full[:, :1].T.contiguous()}
    if layer.endswith(("linear_proj", "linear_fc2")):
        out["smoother"] = torch.ones(1, weight.shape[1])
    return out


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
        tensors = _tensors(load, tmp, hf["num_hidden_layers"], packed, info)
        kv_scales = kv_cache_scales(info)
        for index, (key, value) in kv_scales.items():  # one scale for both: the larger
            name = f"transformer.layers.{index}.attention.kv_cache_scaling_factor"
            tensors[name] = torch.tensor([max(key, value)], dtype=torch.float32)
        dtype = DTYPES[tensors["transformer.ln_f.weight"].dtype]
        (tmp / "out").mkdir()
        save_file(tensors, str(tmp / "out" / "rank0.safetensors"))
        kv_algo = "FP8" if kv_scales else None
        config = trtllm_config(
            hf, dtype, ALGORITHMS.get(info["method"]), info["group_size"], kv_algo
        )
        (tmp / "out" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp / "out", save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported {load} ({info['method']}) as a TensorRT-LLM checkpoint to {save}")
    if info["method"] not in ALGORITHMS:
        log(
            f"note: {info['method']} is stored as its fake-quantized weights in {dtype} "
            "(quant_algo null): TensorRT-LLM's int8 weight-only layout needs its own CUDA "
            "preprocessing (docs/quantization.md, 'Export to TensorRT-LLM')"
        )
    return save


def _tensors(load: Path, tmp: Path, layers: int, packed: dict, info: dict) -> dict:
    """The rank file's tensors: a method TensorRT-LLM stores quantized gets its layout."""
    algorithm = ALGORITHMS.get(info["method"])
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(SafetensorsFolder(tmp / "hf"))
        quantize = None
        if algorithm == "FP8":
            quantize = lambda layer, _names, weight: fp8_linear(packed, layer, weight)  # noqa: E731
        elif algorithm is not None:
            scales = stack.enter_context(SafetensorsFolder(scales_folder(load, tmp)))
            quantize = functools.partial(int4_linear, scales, info["group_size"])
            if algorithm == SMOOTHQUANT:
                quantize = functools.partial(smoothquant_linear, scales)
        tensors = trtllm_tensors(folder, layers, quantize)
    if algorithm == SMOOTHQUANT:  # its norms output int8 (per token): scale_to_int unused, 1
        for i in range(layers):
            for norm in NORMS:
                tensors[f"transformer.layers.{i}.{norm}.scale_to_int"] = torch.ones(1)
    return tensors
