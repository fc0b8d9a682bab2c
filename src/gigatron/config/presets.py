"""Named model shapes (`--model-preset NAME`): configuration data, applied by finalize_config.

A preset only fills model fields the user left at their defaults: explicit flags and YAML values
win (a flag given with its default value cannot be told apart, and is overridden).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gigatron.config.model import ModelConfig
from gigatron.errors import GigatronError

_GPT2 = {
    "seq_length": 1024,
    "max_position_embeddings": 1024,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "openai_gelu": True,
}
_GPT3 = {
    "seq_length": 2048,
    "max_position_embeddings": 2048,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
}
_LLAMA = {
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "layernorm_epsilon": 1e-5,
    "swiglu": True,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "seq_length": 4096,
    "max_position_embeddings": 4096,
}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": {**_GPT2, "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    "gpt2-350m": {**_GPT2, "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16},
    "gpt2-760m": {**_GPT2, "num_layers": 24, "hidden_size": 1536, "num_attention_heads": 16},
    "gpt2-1.5b": {**_GPT2, "num_layers": 48, "hidden_size": 1600, "num_attention_heads": 25},
    "gpt3-175b": {**_GPT3, "num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96},
    "llama2-7b": {
        **_LLAMA,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "ffn_hidden_size": 11008,
    },
    "llama2-13b": {
        **_LLAMA,
        "num_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "ffn_hidden_size": 13824,
    },
    "llama2-70b": {
        **_LLAMA,
        "num_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "group_query_attention": True,
        "num_query_groups": 8,
        "ffn_hidden_size": 28672,
    },
    # Mistral 7B v0.1 without its 4096-token sliding window (identical up to 4096 tokens).
    "mistral-7b": {
        **_LLAMA,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "group_query_attention": True,
        "num_query_groups": 8,
        "ffn_hidden_size": 14336,
    },
}

# The vocabulary of each preset's usual tokenizer (used for parameter counts only).
PRESET_VOCAB_SIZE: dict[str, int] = {
    "gpt2-124m": 50257,
    "gpt2-350m": 50257,
    "gpt2-760m": 50257,
    "gpt2-1.5b": 50257,
    "gpt3-175b": 50257,
    "llama2-7b": 32000,
    "llama2-13b": 32000,
    "llama2-70b": 32000,
    "mistral-7b": 32000,
}

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def apply_preset(cfg, name: str) -> None:
    """Fill cfg.model fields that are still at their defaults with the preset's values."""
    if name not in PRESETS:
        raise GigatronError(f"--model-preset {name!r} is unknown; choose one of: {', '.join(PRESETS)}")
    for field_name, value in PRESETS[name].items():
        if getattr(cfg.model, field_name) == _DEFAULTS[field_name]:
            setattr(cfg.model, field_name, value)
