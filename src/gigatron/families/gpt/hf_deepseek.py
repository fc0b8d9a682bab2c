"""Weight map between gigatron GPT state dicts (full tensors, as at tp = 1, ep = 1) and Hugging
Face `DeepseekV3ForCausalLM`, both directions, and its config.

DeepSeek-V3 in gigatron's terms: multi-latent attention with latent norms
(`--multi-latent-attention --qk-layernorm`), YaRN RoPE (`--rope-type yarn`), SwiGLU, RMSNorm,
no biases, the first `first_k_dense_replace` layers dense and the others MoE (sigmoid scores
with the expert-score correction bias, group-limited top-k, normalised weights scaled by
`routed_scaling_factor`, shared experts).
Besides renaming (attention: q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm,
q_b_proj -> linear_q_up_proj, kv_a_proj_with_mqa -> linear_kv_down_proj, kv_a_layernorm ->
kv_layernorm, kv_b_proj -> linear_kv_up_proj, o_proj -> linear_proj): with `rope_interleave`
(Hugging Face's default) the rotary channels are stored as interleaved pairs (x0, x1), (x2, x3),
...; gigatron rotates halves, so the rows producing each head's rotary query channels and the
shared rotary key are reordered to [x0, x2, ..., x1, x3, ...] (and back on export).
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import pad_rows, sizes_from_hf, yarn_values

StateDict = dict[str, torch.Tensor]


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def _rope_order(dim: int) -> torch.Tensor:
    """Interleaved pairs -> halves: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def _reorder_rope_rows(w: torch.Tensor, heads: int, nope: int, pe: int, inverse: bool):
    """Reorder the rotary rows of a per-head [heads * (nope + pe), ...] weight."""
    order = _rope_order(pe)
    if inverse:
        order = torch.argsort(order)
    w = w.reshape(heads, nope + pe, *w.shape[1:])
    w = torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1)
    return w.reshape(heads * (nope + pe), *w.shape[2:])


def _reorder_kv_down(w: torch.Tensor, rank: int, pe: int, inverse: bool) -> torch.Tensor:
    order = _rope_order(pe)
    if inverse:
        order = torch.argsort(order)
    return torch.cat([w[:rank], w[rank:][order]])


def moe_layers(c: dict[str, Any]) -> list[bool]:
    """Which layers are MoE layers (all after the first `first_k_dense_replace`)."""
    first_dense = c.get("first_k_dense_replace") or 0
    return [i >= first_dense for i in range(c["num_hidden_layers"])]


class DeepseekV3HFAdapter:
    """DeepSeek-V3's Hugging Face adapter (`DeepseekV3ForCausalLM`)."""

    hf_class_name = "DeepseekV3ForCausalLM"

    def config_from_hf(self, hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(ModelConfig values plus `vocab_size`, MoEConfig values) for a DeepseekV3Config."""
        c = _hf_dict(hf_config)
        if c.get("attention_bias"):
            raise GigatronError("DeepSeek-V3 with attention_bias: MLA here has no biases")
        if not c.get("norm_topk_prob", True):
            raise GigatronError(
                "DeepSeek-V3 with norm_topk_prob false: gigatron normalises sigmoid top-k scores"
            )
        rope = c.get("rope_parameters") or {}
        model: dict[str, Any] = {
            **sizes_from_hf(c),
            "position_embedding_type": "rope",
            "normalization": "RMSNorm",
            "layernorm_epsilon": c["rms_norm_eps"],
            "swiglu": True,
            "add_bias_linear": False,
            "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
            "multi_latent_attention": True,
            "qk_layernorm": True,
            "q_lora_rank": c.get("q_lora_rank"),
            "kv_lora_rank": c["kv_lora_rank"],
            "qk_head_dim": c["qk_nope_head_dim"],
            "qk_pos_emb_head_dim": c["qk_rope_head_dim"],
            "v_head_dim": c["v_head_dim"],
            "rotary_base": int(rope.get("rope_theta", 10000)),
            "vocab_size": c["vocab_size"],
        }
        if rope.get("rope_type", "default") == "yarn":
            model.update(
                rope_type="yarn",
                mscale=rope.get("mscale") or 1.0,
                mscale_all_dim=rope.get("mscale_all_dim") or 0.0,
                **yarn_values(rope),
            )
        else:
            model["rope_type"] = "rope"
        pattern = "[" + ",".join(str(int(v)) for v in moe_layers(c)) + "]"
        moe: dict[str, Any] = {
            "num_experts": c["n_routed_experts"],
            "moe_ffn_hidden_size": c["moe_intermediate_size"],
            "moe_router_topk": c["num_experts_per_tok"],
            "moe_layer_freq": pattern,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": c.get("n_group"),
            "moe_router_group_topk": c.get("topk_group"),
            "moe_router_topk_scaling_factor": c.get("routed_scaling_factor"),
            "moe_router_dtype": "fp32",
        }
        if c.get("n_shared_experts"):
            moe["moe_shared_expert_intermediate_size"] = (
                c["n_shared_experts"] * c["moe_intermediate_size"]
            )
        return model, moe

    def _attention_names(self, c: dict[str, Any]) -> list[tuple[str, str]]:
        names = [
            ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
            ("kv_layernorm.weight", "kv_a_layernorm.weight"),
            ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
            ("linear_proj.weight", "o_proj.weight"),
        ]
        if c.get("q_lora_rank") is None:
            return [("linear_q_proj.weight", "q_proj.weight"), *names]
        return [
            ("linear_q_down_proj.weight", "q_a_proj.weight"),
            ("q_layernorm.weight", "q_a_layernorm.weight"),
            ("linear_q_up_proj.weight", "q_b_proj.weight"),
            *names,
        ]

    def _convert(self, tensors: StateDict, c: dict[str, Any], to_hf: bool) -> StateDict:
        """The per-layer part of both directions (`to_hf`: gigatron names in, HF names out)."""
        out: StateDict = {}
        heads, nope, pe = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        interleave = c.get("rope_interleave", True)
        for i, is_moe in enumerate(moe_layers(c)):
            ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
            pairs = [
                ("input_layernorm.weight", "input_layernorm.weight"),
                ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
            ]
            pairs += [
                (f"self_attention.{a}", f"self_attn.{b}") for a, b in self._attention_names(c)
            ]
            if is_moe:
                pairs += [
                    ("mlp.router.weight", "mlp.gate.weight"),
                    ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
                    ("mlp.experts.linear_fc1.weight", "mlp.experts.gate_up_proj"),
                    ("mlp.experts.linear_fc2.weight", "mlp.experts.down_proj"),
                ]
                if c.get("n_shared_experts"):
                    pairs.append(
                        (
                            "mlp.shared_experts.linear_fc2.weight",
                            "mlp.shared_experts.down_proj.weight",
                        )
                    )
                fused = ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.")
            else:
                pairs.append(("mlp.linear_fc2.weight", "mlp.down_proj.weight"))
                fused = ("mlp.linear_fc1.weight", "mlp.")
            for a, b in pairs:
                src, dst = (ours + a, theirs + b) if to_hf else (theirs + b, ours + a)
                tensor = tensors[src]
                if interleave and a.endswith(("q_proj.weight", "q_up_proj.weight")):
                    tensor = _reorder_rope_rows(tensor, heads, nope, pe, inverse=to_hf)
                elif interleave and a.endswith("kv_down_proj.weight"):
                    tensor = _reorder_kv_down(tensor, c["kv_lora_rank"], pe, inverse=to_hf)
                out[dst] = tensor
            if is_moe and not c.get("n_shared_experts"):
                continue
            gigatron_name, hf_prefix = ours + fused[0], theirs + fused[1]
            if to_hf:
                gate, up = tensors[gigatron_name].chunk(2)
                out[hf_prefix + "gate_proj.weight"], out[hf_prefix + "up_proj.weight"] = gate, up
            else:
                out[gigatron_name] = torch.cat(
                    [tensors[hf_prefix + "gate_proj.weight"], tensors[hf_prefix + "up_proj.weight"]]
                )
        return out

    def from_hf(self, hf: StateDict, hf_config: Any, padded_vocab_size: int) -> StateDict:
        """DeepseekV3ForCausalLM state dict -> gigatron GPT state dict."""
        c = _hf_dict(hf_config)
        sd = {
            "embedding.word_embeddings.weight": pad_rows(
                hf["model.embed_tokens.weight"], padded_vocab_size
            ),
            "decoder.final_layernorm.weight": hf["model.norm.weight"],
            **self._convert(hf, c, to_hf=False),
        }
        if not c.get("tie_word_embeddings", False):
            sd["output_layer.weight"] = pad_rows(hf["lm_head.weight"], padded_vocab_size)
        return {name: tensor.contiguous().clone() for name, tensor in sd.items()}

    def to_hf(self, sd: StateDict, hf_config: Any) -> StateDict:
        """gigatron GPT state dict (shaped as `hf_config`) -> DeepseekV3ForCausalLM state dict."""
        c = _hf_dict(hf_config)
        vocab = c["vocab_size"]
        embed = sd["embedding.word_embeddings.weight"][:vocab]
        head = sd.get("output_layer.weight")
        hf = {
            "model.embed_tokens.weight": embed,
            "model.norm.weight": sd["decoder.final_layernorm.weight"],
            "lm_head.weight": embed if head is None else head[:vocab],
            **self._convert(sd, c, to_hf=True),
        }
        return {name: tensor.contiguous().clone() for name, tensor in hf.items()}
