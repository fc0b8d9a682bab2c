"""Weight maps between gigatron MoE GPT state dicts (full tensors, as at ep = 1, tp = 1) and
Hugging Face `MixtralForCausalLM` / `Qwen2MoeForCausalLM`, both directions, and their configs.

Attention, norms and embeddings map as for Llama (see hf_mapping.py; Qwen2-MoE adds q/k/v
biases, fused like the weights). MoE layers:
    mlp.gate.weight [E, h]                    <-> mlp.router.weight
    mlp.experts.gate_up_proj [E, 2F, h]       <-> mlp.experts.linear_fc1.weight ([gate; up])
    mlp.experts.down_proj [E, h, F]           <-> mlp.experts.linear_fc2.weight
    mlp.shared_expert.{gate,up,down}_proj     <-> mlp.shared_experts.linear_fc1/2 (Qwen2-MoE)
    mlp.shared_expert_gate.weight [1, h]      <-> mlp.shared_experts.gate_weight
Routing: Mixtral renormalises the top-k softmax (= a softmax over the top-k logits, gigatron's
default); Qwen2-MoE without `norm_topk_prob` keeps the full softmax values
(`--moe-router-pre-softmax`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import (
    export_ends,
    fuse_qkv,
    llama_like_values,
    pad_rows,
    split_qkv,
)

Tensor = torch.Tensor
StateDict = dict[str, Tensor]


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def moe_layer_flags(c: dict[str, Any]) -> list[bool]:
    """Which layers of a Hugging Face config are MoE layers (none for dense Llama-like models)."""
    layers = c["num_hidden_layers"]
    if c.get("model_type") == "qwen2_moe":
        dense = set(c.get("mlp_only_layers") or [])
        step = c.get("decoder_sparse_step", 1)
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return [c.get("model_type") == "mixtral"] * layers


class ExpertFilesView(Mapping):
    """A state dict read from files where each expert has its own tensors
    (`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`, as `save_pretrained` writes
    DeepSeek-V3 and Qwen2-MoE) that also serves the model's fused `mlp.experts.gate_up_proj`
    [E, 2F, h] and `mlp.experts.down_proj` [E, h, F]."""

    def __init__(self, hf: Any, experts: int) -> None:
        self.hf, self.experts = hf, experts

    def _base(self, name: str) -> tuple[str, str] | None:
        for fused in ("gate_up_proj", "down_proj"):
            if name.endswith(".experts." + fused):
                base = name[: -len(fused)]
                if f"{base}0.down_proj.weight" in self.hf:
                    return base, fused
        return None

    def __getitem__(self, name: str) -> Tensor:
        if name in self.hf:
            return self.hf[name]
        found = self._base(name)
        if found is None:
            raise KeyError(name)
        base, fused = found
        ids = range(self.experts)
        if fused == "down_proj":
            return torch.stack([self.hf[f"{base}{j}.down_proj.weight"] for j in ids])
        return torch.stack(
            [
                torch.cat(
                    [self.hf[f"{base}{j}.gate_proj.weight"], self.hf[f"{base}{j}.up_proj.weight"]]
                )
                for j in ids
            ]
        )

    def __contains__(self, name: object) -> bool:
        return name in self.hf or (isinstance(name, str) and self._base(name) is not None)

    def __iter__(self):
        return iter(self.hf)

    def __len__(self) -> int:
        return len(self.hf)


def _expert_file_names(c: dict[str, Any]) -> tuple[str, tuple[str, str, str]]:
    """(block name, (gate, up, down) names) of the per-expert tensors `save_pretrained` writes."""
    if c.get("model_type") == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def _moe_weights(hf: Any, src: str, c: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """(router, experts fc1 [E, 2F, h], experts fc2 [E, h, F]) of layer `src`, from the model's
    fused tensors or from the per-expert tensors of its files."""
    mlp = src + "mlp."
    if mlp + "experts.gate_up_proj" in hf:
        return (
            hf[mlp + "gate.weight"],
            hf[mlp + "experts.gate_up_proj"],
            hf[mlp + "experts.down_proj"],
        )
    block, (gate, up, down) = _expert_file_names(c)
    base = f"{src}{block}."
    count = c["num_local_experts"] if c.get("model_type") == "mixtral" else c["num_experts"]
    experts = [f"{base}experts.{j}." for j in range(count)]
    fc1 = torch.stack(
        [torch.cat([hf[e + gate + ".weight"], hf[e + up + ".weight"]]) for e in experts]
    )
    fc2 = torch.stack([hf[e + down + ".weight"] for e in experts])
    return hf[base + "gate.weight"], fc1, fc2


def state_to_files(hf: StateDict, hf_config: Any) -> StateDict:
    """A Mixtral / Qwen2-MoE state dict with the names `save_pretrained` writes: one tensor per
    expert (Mixtral: `block_sparse_moe.experts.{j}.w1/w3/w2`, `block_sparse_moe.gate`)."""
    c = _hf_dict(hf_config)
    if c.get("model_type") not in ("mixtral", "qwen2_moe", "deepseek_v3"):
        return hf
    block, (gate, up, down) = _expert_file_names(c)
    out: StateDict = {}
    for name, tensor in hf.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[: -len("mlp.experts.gate_up_proj")] + block + ".experts."
            for j, fused in enumerate(tensor.unbind(0)):
                first, second = fused.chunk(2)
                out[f"{base}{j}.{gate}.weight"] = first
                out[f"{base}{j}.{up}.weight"] = second
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("mlp.experts.down_proj")] + block + ".experts."
            for j, weight in enumerate(tensor.unbind(0)):
                out[f"{base}{j}.{down}.weight"] = weight
        elif name.endswith(".mlp.gate.weight"):
            out[name[: -len("mlp.gate.weight")] + block + ".gate.weight"] = tensor
        else:
            out[name] = tensor
    return out


def config_from_hf(hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelConfig values plus `vocab_size`, MoEConfig values) for a Mixtral or Qwen2-MoE
    config (a PretrainedConfig or its dict)."""
    c = _hf_dict(hf_config)
    model_type = c.get("model_type")
    if model_type not in ("mixtral", "qwen2_moe"):
        raise GigatronError(
            f"Hugging Face model_type {model_type!r} is not a supported MoE model; supported: "
            "mixtral, qwen2_moe"
        )
    model = llama_like_values(c)
    pattern = "[" + ",".join(str(int(v)) for v in moe_layer_flags(c)) + "]"
    moe: dict[str, Any] = {
        "num_experts": c["num_local_experts"] if model_type == "mixtral" else c["num_experts"],
        "moe_router_topk": c["num_experts_per_tok"],
        "moe_layer_freq": pattern,
    }
    if model_type == "mixtral":
        moe["moe_ffn_hidden_size"] = c["intermediate_size"]
        if c.get("router_jitter_noise"):
            moe["moe_input_jitter_eps"] = c["router_jitter_noise"]
    else:
        model["add_qkv_bias"] = bool(c.get("qkv_bias", True))
        moe["moe_ffn_hidden_size"] = c["moe_intermediate_size"]
        moe["moe_router_pre_softmax"] = not c.get("norm_topk_prob", False)
        if c.get("shared_expert_intermediate_size"):
            moe["moe_shared_expert_intermediate_size"] = c["shared_expert_intermediate_size"]
            moe["moe_shared_expert_gate"] = True
    return model, moe


def hf_to_gigatron(hf: StateDict, hf_config: Any, padded_vocab_size: int) -> StateDict:
    """MixtralForCausalLM / Qwen2MoeForCausalLM state dict -> gigatron GPT state dict."""
    c = _hf_dict(hf_config)
    groups = c.get("num_key_value_heads") or c["num_attention_heads"]
    out: StateDict = {
        "embedding.word_embeddings.weight": pad_rows(
            hf["model.embed_tokens.weight"], padded_vocab_size
        ),
        "decoder.final_layernorm.weight": hf["model.norm.weight"].clone(),
    }
    if not c.get("tie_word_embeddings", False):
        out["output_layer.weight"] = pad_rows(hf["lm_head.weight"], padded_vocab_size)
    for i, is_moe in enumerate(moe_layer_flags(c)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in hf:
                q, k, v = (hf[attn + f"{name}_proj.{kind}"] for name in "qkv")
                out[dst + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, groups)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"].clone()
        mlp, gmlp = src + "mlp.", dst + "mlp."
        if not is_moe:
            out[gmlp + "linear_fc1.weight"] = torch.cat(
                [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]
            )
            out[gmlp + "linear_fc2.weight"] = hf[mlp + "down_proj.weight"].clone()
            continue
        router, fc1, fc2 = _moe_weights(hf, src, c)
        out[gmlp + "router.weight"] = router.clone()
        out[gmlp + "experts.linear_fc1.weight"] = fc1.clone()
        out[gmlp + "experts.linear_fc2.weight"] = fc2.clone()
        shared = mlp + "shared_expert."
        if shared + "gate_proj.weight" in hf:
            out[gmlp + "shared_experts.linear_fc1.weight"] = torch.cat(
                [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]]
            )
            out[gmlp + "shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"].clone()
            out[gmlp + "shared_experts.gate_weight"] = hf[mlp + "shared_expert_gate.weight"].clone()
    return out


def gigatron_to_hf(sd: StateDict, hf_config: Any) -> StateDict:
    """gigatron GPT state dict (shaped as `hf_config`) -> the Hugging Face model's state dict."""
    c = _hf_dict(hf_config)
    heads = c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    channels = c.get("head_dim") or c["hidden_size"] // heads
    vocab = c["vocab_size"]
    out = export_ends(sd, vocab, "model.embed_tokens.weight", "model.norm.weight", True)
    for i, is_moe in enumerate(moe_layer_flags(c)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            fused = sd.get(src + f"self_attention.linear_qkv.{kind}")
            if fused is not None:
                for name, part in zip("qkv", split_qkv(fused, heads, groups, channels)):
                    out[dst + f"self_attn.{name}_proj.{kind}"] = part
        out[dst + "self_attn.o_proj.weight"] = sd[src + "self_attention.linear_proj.weight"].clone()
        mlp, gmlp = dst + "mlp.", src + "mlp."
        if not is_moe:
            gate, up = sd[gmlp + "linear_fc1.weight"].chunk(2)
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate.clone(), up.clone()
            out[mlp + "down_proj.weight"] = sd[gmlp + "linear_fc2.weight"].clone()
            continue
        out[mlp + "gate.weight"] = sd[gmlp + "router.weight"].clone()
        out[mlp + "experts.gate_up_proj"] = sd[gmlp + "experts.linear_fc1.weight"].clone()
        out[mlp + "experts.down_proj"] = sd[gmlp + "experts.linear_fc2.weight"].clone()
        if gmlp + "shared_experts.linear_fc1.weight" in sd:
            gate, up = sd[gmlp + "shared_experts.linear_fc1.weight"].chunk(2)
            shared = mlp + "shared_expert."
            out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = gate, up
            out[shared + "down_proj.weight"] = sd[gmlp + "shared_experts.linear_fc2.weight"]
            out[mlp + "shared_expert_gate.weight"] = sd[gmlp + "shared_experts.gate_weight"]
    return out
