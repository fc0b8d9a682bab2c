"""The GPT family's Hugging Face adapter: GPT-2, Llama (1/2/3), Mistral, Qwen2, Mixtral,
Qwen2-MoE, gpt-oss and DeepSeek-V3 (the adapter protocol: checkpoint/hf_adapter.py).

GPT-2 uses the maps of hf_mapping.py; the Llama-like models those of hf_moe.py (a dense model is
the MoE map with no MoE layer; Qwen2's q/k/v biases are fused like the weights). RoPE scaling as
`transformers` defines it: `linear` is Megatron's --rotary-seq-len-interpolation-factor,
`llama3` (with Llama 3.1's low/high frequency factors 1 and 4 and 8192 original positions) is
--use-rope-scaling --rope-scaling-factor; other kinds are refused.
"""

from __future__ import annotations

import warnings
from typing import Any

from gigatron.errors import GigatronError
from gigatron.families import hf_mapping
from gigatron.families.gpt import hf_moe
from gigatron.families.gpt.hf_deepseek import DeepseekV3HFAdapter
from gigatron.families.gpt.hf_gpt_oss import GptOssHFAdapter

_LLAMA_LIKE = ("llama", "mistral", "qwen2")
_MOE = ("mixtral", "qwen2_moe")
# Models with adapters of their own (attention sinks and windows; multi-latent attention).
_OWN = {"gpt_oss": GptOssHFAdapter, "deepseek_v3": DeepseekV3HFAdapter}
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_POSITIONS = 8192


def _dict(hf_config: Any) -> dict[str, Any]:
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def rope_values(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and scaling flags for a Hugging Face config (old `rope_scaling` or
    transformers 5's `rope_parameters`)."""
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    theta = c.get("rope_theta") or params.get("rope_theta") or 10000
    values: dict[str, Any] = {"rotary_base": int(theta)}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return values
    if kind == "linear":
        values["rotary_seq_len_interpolation_factor"] = float(params["factor"])
        return values
    if kind == "llama3":
        fixed = {k: float(params.get(k, v)) for k, v in _LLAMA3_FIXED.items()}
        positions = int(params.get("original_max_position_embeddings", _LLAMA3_POSITIONS))
        if fixed != _LLAMA3_FIXED or positions != _LLAMA3_POSITIONS:
            raise GigatronError(
                f"config.json rope parameters {params}: llama3 scaling is supported with "
                "low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings "
                "8192 (Megatron's --use-rope-scaling)"
            )
        values.update(use_rope_scaling=True, rope_scaling_factor=float(params["factor"]))
        return values
    raise GigatronError(
        f"config.json rope_type {kind!r}: not supported by gigatron; supported: default, "
        "linear, llama3"
    )


def _llama_values(c: dict[str, Any]) -> dict[str, Any]:
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise GigatronError(
            "config.json attention_bias/mlp_bias: biases on every projection are not supported "
            "for Llama models (Qwen2's q/k/v biases are)"
        )
    positions = c.get("max_position_embeddings", 4096)
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    if window and window < positions:
        warnings.warn(
            f"config.json sliding_window {window}: gigatron attends to every earlier position; "
            f"sequences longer than {window} tokens give other results than the original",
            stacklevel=2,
        )
    values = hf_mapping.llama_like_values(c)
    values["add_qkv_bias"] = c.get("model_type") == "qwen2"
    values.update(rope_values(c))
    return values


class GPTHFAdapter:
    """Decoder-only language models (`AutoModelForCausalLM`)."""

    model_types = ("gpt2", *_LLAMA_LIKE, *_MOE, *_OWN)
    auto_class = "AutoModelForCausalLM"

    def config_from_hf(self, hf_config: Any) -> dict[str, Any]:
        """gigatron ModelConfig (and MoEConfig) values plus `vocab_size`."""
        c = _dict(hf_config)
        kind = c.get("model_type")
        if kind == "gpt2":
            return hf_mapping.model_config_from_hf(c)
        if kind in _LLAMA_LIKE:
            return _llama_values(c)
        if kind in _MOE:
            model, moe = hf_moe.config_from_hf(c)
            model.update(rope_values(c))
            return {**model, **moe}
        if kind in _OWN:
            model, moe = _OWN[kind]().config_from_hf(c)
            return {**model, **moe}
        raise GigatronError(
            f"config.json model_type {kind!r}: not a GPT-family model; supported: "
            f"{', '.join(self.model_types)}"
        )

    def from_hf(
        self, hf: Any, num_layers: int, num_heads: int, padded_vocab: int, hf_config: Any = None
    ) -> dict[str, Any]:
        c = _dict(hf_config)
        kind = c.get("model_type")
        if kind == "gpt2":
            return hf_mapping.gpt2_to_gigatron(hf, num_layers, num_heads, padded_vocab)
        if kind == "deepseek_v3":
            hf = hf_moe.ExpertFilesView(hf, c["n_routed_experts"])
        if kind in _OWN:
            return _OWN[kind]().from_hf(hf, c, padded_vocab)
        return hf_moe.hf_to_gigatron(hf, c, padded_vocab)

    def to_hf(
        self, sd: Any, num_layers: int, num_heads: int, vocab_size: int, hf_config: Any = None
    ) -> dict[str, Any]:
        c = _dict(hf_config)
        kind = c.get("model_type")
        if kind == "gpt2":
            return hf_mapping.gigatron_to_gpt2(sd, num_layers, num_heads, vocab_size)
        if kind in _OWN:
            return _OWN[kind]().to_hf(sd, c)
        return hf_moe.gigatron_to_hf(sd, c)

    def config_to_hf(self, cfg: Any, vocab_size: int) -> dict[str, Any]:
        """A `config.json` for a gigatron GPT model that was not imported: GPT-2 (learned
        positions, LayerNorm, GeLU), or Llama / Qwen2 (q/k/v biases) / Mixtral (MoE) for RoPE,
        RMSNorm and SwiGLU models."""
        m, moe = cfg.model, cfg.moe
        tied = not m.untie_embeddings_and_output_weights
        gpt2 = (m.position_embedding_type, m.normalization, m.swiglu, m.add_bias_linear) == (
            "learned_absolute", "LayerNorm", False, True
        )  # fmt: skip
        if gpt2 and tied and not moe.num_experts:
            return {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": vocab_size,
                "n_layer": m.num_layers,
                "n_embd": m.hidden_size,
                "n_head": m.num_attention_heads,
                "n_inner": m.ffn_hidden_size,
                "n_positions": m.max_position_embeddings,
                "layer_norm_epsilon": m.layernorm_epsilon,
                "activation_function": "gelu_new" if m.openai_gelu else "gelu",
                "tie_word_embeddings": True,
            }
        llama = (m.position_embedding_type, m.normalization, m.swiglu, m.add_bias_linear) == (
            "rope", "RMSNorm", True, False
        )  # fmt: skip
        if not llama or m.rotary_percent != 1.0:
            raise GigatronError(
                "this GPT model has no Hugging Face architecture: exported are GPT-2 shaped models "
                "(learned positions, LayerNorm, GeLU, biases, tied) and Llama shaped ones (RoPE, "
                "RMSNorm, SwiGLU, no biases but Qwen2's q/k/v biases)"
            )
        heads = m.num_attention_heads
        config: dict[str, Any] = {
            "vocab_size": vocab_size,
            "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": m.num_query_groups if m.group_query_attention else heads,
            "head_dim": m.kv_channels,
            "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.layernorm_epsilon,
            "hidden_act": "silu",
            "tie_word_embeddings": tied,
            "rope_theta": float(m.rotary_base),
        }
        if m.use_rope_scaling:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": m.rope_scaling_factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        elif m.rotary_seq_len_interpolation_factor:
            config["rope_scaling"] = {
                "rope_type": "linear",
                "factor": m.rotary_seq_len_interpolation_factor,
            }
        if moe.num_experts:
            if moe.moe_shared_expert_intermediate_size or m.add_qkv_bias:
                raise GigatronError(
                    "this MoE model has no Hugging Face architecture (Mixtral: no shared experts, "
                    "no q/k/v biases)"
                )
            return {
                **config,
                "model_type": "mixtral",
                "architectures": ["MixtralForCausalLM"],
                "intermediate_size": moe.moe_ffn_hidden_size or m.ffn_hidden_size,
                "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.moe_router_topk,
            }
        if m.add_qkv_bias:
            return {**config, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
        return {**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    def to_hf_files(self, hf_state: dict[str, Any], hf_config: Any) -> dict[str, Any]:
        """The names `save_pretrained` writes (per-expert tensors for the MoE models)."""
        return hf_moe.state_to_files(hf_state, hf_config)
