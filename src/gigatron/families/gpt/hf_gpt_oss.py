"""Weight map between gigatron GPT state dicts (full tensors, as at tp = 1) and Hugging Face
`GptOssForCausalLM`, both directions, and its config.

gpt-oss in gigatron's terms: RMSNorm, biases on every linear layer (`add_bias_linear`), learned
softmax sinks (`--softmax-type learnable`: `self_attn.sinks` <-> `core_attention.softmax_offset`),
sliding-window attention on the layers `layer_types` names "sliding_attention" (Hugging Face's
window of W keys is `--window-size (W-1,0)`), YaRN RoPE, and the quick-GeGLU MLP with a linear
offset of 1 and the clamp `swiglu_limit`.
Every layer is an MoE layer: the router has a bias, top-k of the logits then a softmax over
them (gigatron's default routing), and the experts have biases (`add_bias_linear`).
Besides renaming: q, k, v are fused per query group (with their biases); the experts' fused
`gate_up_proj` [E, h, 2F] interleaves gate and up columns (gate = even, up = odd), gigatron's
`experts.linear_fc1.weight` [E, 2F, h] holds [gate; up] rows; `down_proj` [E, F, h] is
transposed to [E, h, F].
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import export_ends, fuse_qkv, pad_rows, split_qkv, yarn_values

StateDict = dict[str, torch.Tensor]
QUICK_GELU_ALPHA = 1.702


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def _window_pattern(c: dict[str, Any]) -> str:
    types = c.get("layer_types") or []
    return "[" + ",".join("1" if t == "sliding_attention" else "0" for t in types) + "]"


class GptOssHFAdapter:
    """gpt-oss's Hugging Face adapter (`GptOssForCausalLM`)."""

    hf_class_name = "GptOssForCausalLM"

    def config_from_hf(self, hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(ModelConfig values plus `vocab_size`, MoEConfig values) for a GptOssConfig."""
        c = _hf_dict(hf_config)
        if abs(c.get("swiglu_alpha", QUICK_GELU_ALPHA) - QUICK_GELU_ALPHA) > 1e-9:
            raise GigatronError(
                f"gpt-oss swiglu_alpha {c['swiglu_alpha']}: gigatron's quick GeLU uses 1.702"
            )
        rope = c.get("rope_parameters") or {}
        heads = c["num_attention_heads"]
        groups = c.get("num_key_value_heads") or heads
        values = {
            "num_layers": c["num_hidden_layers"],
            "hidden_size": c["hidden_size"],
            "num_attention_heads": heads,
            "group_query_attention": groups != heads,
            "num_query_groups": groups,
            "kv_channels": c["head_dim"],
            "ffn_hidden_size": c["intermediate_size"],
            "seq_length": c["max_position_embeddings"],
            "max_position_embeddings": c["max_position_embeddings"],
            "normalization": "RMSNorm",
            "layernorm_epsilon": c["rms_norm_eps"],
            "add_bias_linear": bool(c.get("attention_bias", True)),
            "quick_geglu": True,
            "glu_linear_offset": 1.0,
            "activation_func_clamp_value": c["swiglu_limit"],
            "softmax_type": "learnable",
            "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
            "rotary_base": int(rope.get("rope_theta", 150000)),
            "vocab_size": c["vocab_size"],
        }
        if c.get("sliding_window"):
            values["window_size"] = f"({c['sliding_window'] - 1},0)"
            values["window_attn_skip_freq"] = _window_pattern(c)
        if rope.get("rope_type", "default") == "yarn":
            values.update(position_embedding_type="yarn", **yarn_values(rope))
        else:
            values["position_embedding_type"] = "rope"
        moe = {
            "num_experts": c["num_local_experts"],
            "moe_router_topk": c["num_experts_per_tok"],
            "moe_ffn_hidden_size": c["intermediate_size"],
            "moe_layer_freq": "1",
        }
        return values, moe

    def from_hf(self, hf: StateDict, hf_config: Any, padded_vocab_size: int) -> StateDict:
        """GptOssForCausalLM state dict -> gigatron GPT state dict."""
        c = _hf_dict(hf_config)
        groups = c.get("num_key_value_heads") or c["num_attention_heads"]
        sd: StateDict = {
            "embedding.word_embeddings.weight": pad_rows(
                hf["model.embed_tokens.weight"], padded_vocab_size
            ),
            "decoder.final_layernorm.weight": hf["model.norm.weight"],
        }
        if not c.get("tie_word_embeddings", False):
            sd["output_layer.weight"] = pad_rows(hf["lm_head.weight"], padded_vocab_size)
        for i in range(c["num_hidden_layers"]):
            src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
            attn, mlp = src + "self_attn.", src + "mlp.experts."
            sd[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
            sd[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
            for kind in ("weight", "bias"):
                if attn + f"q_proj.{kind}" in hf:
                    q, k, v = (hf[attn + f"{n}_proj.{kind}"] for n in "qkv")
                    sd[dst + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, groups)
                if attn + f"o_proj.{kind}" in hf:
                    sd[dst + f"self_attention.linear_proj.{kind}"] = hf[attn + f"o_proj.{kind}"]
            sd[dst + "self_attention.core_attention.softmax_offset"] = hf[attn + "sinks"]
            gate_up, gate_up_bias = hf[mlp + "gate_up_proj"], hf[mlp + "gate_up_proj_bias"]
            experts, router = dst + "mlp.experts.", src + "mlp.router."
            sd[dst + "mlp.router.weight"] = hf[router + "weight"]
            sd[dst + "mlp.router.bias"] = hf[router + "bias"]
            halves = [gate_up[..., 0::2], gate_up[..., 1::2]]
            sd[experts + "linear_fc1.weight"] = torch.cat(halves, dim=2).transpose(1, 2)
            bias_halves = [gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]]
            sd[experts + "linear_fc1.bias"] = torch.cat(bias_halves, dim=1)
            sd[experts + "linear_fc2.weight"] = hf[mlp + "down_proj"].transpose(1, 2)
            sd[experts + "linear_fc2.bias"] = hf[mlp + "down_proj_bias"]
        return {name: tensor.contiguous().clone() for name, tensor in sd.items()}

    def to_hf(self, sd: StateDict, hf_config: Any) -> StateDict:
        """gigatron GPT state dict (shaped as `hf_config`) -> GptOssForCausalLM state dict."""
        c = _hf_dict(hf_config)
        heads = c["num_attention_heads"]
        groups = c.get("num_key_value_heads") or heads
        vocab = c["vocab_size"]
        hf = export_ends(sd, vocab, "model.embed_tokens.weight", "model.norm.weight", False)
        for i in range(c["num_hidden_layers"]):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            attn, mlp = dst + "self_attn.", dst + "mlp."
            hf[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
            hf[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"]
            for kind in ("weight", "bias"):
                fused = sd.get(src + f"self_attention.linear_qkv.{kind}")
                if fused is not None:
                    parts = split_qkv(fused, heads, groups, c["head_dim"])
                    for name, part in zip("qkv", parts):
                        hf[attn + f"{name}_proj.{kind}"] = part
                proj = sd.get(src + f"self_attention.linear_proj.{kind}")
                if proj is not None:
                    hf[attn + f"o_proj.{kind}"] = proj
            hf[attn + "sinks"] = sd[src + "self_attention.core_attention.softmax_offset"]
            experts = src + "mlp.experts."
            gate, up = sd[experts + "linear_fc1.weight"].transpose(1, 2).chunk(2, dim=2)
            gate_b, up_b = sd[experts + "linear_fc1.bias"].chunk(2, dim=1)
            hf[mlp + "experts.gate_up_proj"] = torch.stack([gate, up], dim=3).flatten(2)
            hf[mlp + "experts.gate_up_proj_bias"] = torch.stack([gate_b, up_b], dim=2).flatten(1)
            hf[mlp + "experts.down_proj"] = sd[experts + "linear_fc2.weight"].transpose(1, 2)
            hf[mlp + "experts.down_proj_bias"] = sd[experts + "linear_fc2.bias"]
            hf[mlp + "router.weight"] = sd[src + "mlp.router.weight"]
            hf[mlp + "router.bias"] = sd[src + "mlp.router.bias"]
        return {name: tensor.contiguous().clone() for name, tensor in hf.items()}
