"""The GPT family's Hugging Face adapter: GPT-2, Llama (1/2/3), Mistral, Qwen2, Mixtral and
Qwen2-MoE (the adapter protocol: checkpoint/hf_adapter.py).

GPT-2 uses the maps of hf_mapping.py; the Llama-like models those of hf_moe.py (a dense model is
the MoE map with no MoE layer; Qwen2's q/k/v biases are fused like the weights). RoPE scaling as
`transformers` defines it: `linear` is Megatron's --rotary-seq-len-interpolation-factor,
`llama3` (with Llama 3.1's low/high frequency factors 1 and 4 and 8192 original positions) is
--use-rope-scaling --rope-scaling-factor; other kinds are refused.
"""

from __future__ import annotations

import warnings
from typing import Any

from gigatron.checkpoint import hf_mapping, hf_moe
from gigatron.errors import GigatronError

_LLAMA_LIKE = ("llama", "mistral", "qwen2")
_MOE = ("mixtral", "qwen2_moe")
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
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    groups = c.get("num_key_value_heads") or heads
    positions = c.get("max_position_embeddings", 4096)
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    if window and window < positions:
        warnings.warn(
            f"config.json sliding_window {window}: gigatron attends to every earlier position; "
            f"sequences longer than {window} tokens give other results than the original",
            stacklevel=2,
        )
    values = {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": c.get("head_dim") or hidden // heads,
        "ffn_hidden_size": c["intermediate_size"],
        "seq_length": positions,
        "max_position_embeddings": positions,
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "layernorm_epsilon": c.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "add_bias_linear": False,
        "add_qkv_bias": c.get("model_type") == "qwen2",
        "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
        "vocab_size": c["vocab_size"],
    }
    values.update(rope_values(c))
    return values


class GPTHFAdapter:
    """Decoder-only language models (`AutoModelForCausalLM`)."""

    model_types = ("gpt2", *_LLAMA_LIKE, *_MOE)
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
        raise GigatronError(
            f"config.json model_type {kind!r}: not a GPT-family model; supported: "
            f"{', '.join(self.model_types)}"
        )

    def from_hf(
        self, hf: Any, num_layers: int, num_heads: int, padded_vocab: int, hf_config: Any = None
    ) -> dict[str, Any]:
        c = _dict(hf_config)
        if c.get("model_type") == "gpt2":
            return hf_mapping.gpt2_to_gigatron(hf, num_layers, num_heads, padded_vocab)
        return hf_moe.hf_to_gigatron(hf, c, padded_vocab)

    def to_hf(
        self, sd: Any, num_layers: int, num_heads: int, vocab_size: int, hf_config: Any = None
    ) -> dict[str, Any]:
        c = _dict(hf_config)
        if c.get("model_type") == "gpt2":
            return hf_mapping.gigatron_to_gpt2(sd, num_layers, num_heads, vocab_size)
        return hf_moe.gigatron_to_hf(sd, c)

    def to_hf_files(self, hf_state: dict[str, Any], hf_config: Any) -> dict[str, Any]:
        """The names `save_pretrained` writes (per-expert tensors for the MoE models)."""
        return hf_moe.state_to_files(hf_state, hf_config)
