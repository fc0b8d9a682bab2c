"""Weight maps between gigatron GPT state dicts (full tensors, as at tp = 1) and Hugging Face
`GPT2LMHeadModel` / `LlamaForCausalLM` state dicts, both directions.

What the maps do besides renaming:
- QKV: Hugging Face keeps q, k, v apart (GPT-2: one Conv1D with [q | k | v] columns); gigatron
  fuses them grouped per query group, [ng, (np/ng + 2) * hn, h] (see models/transformer.py), so
  with grouped-query attention the query heads of each group are regrouped next to its k and v.
- GPT-2's Conv1D stores weights as [in, out]: transposed to nn.Linear's [out, in].
- SwiGLU: gate_proj and up_proj are stacked into linear_fc1 = [gate; up].
- Vocabulary: gigatron pads the embedding (and untied output) rows to the padded vocabulary;
  import pads with zero rows, export drops them.
- RoPE needs no permutation: Hugging Face Llama checkpoints already use the rotate-half form
  that gigatron uses (the permutation from Meta's interleaved form happened when they were
  converted to Hugging Face).
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError

Tensor = torch.Tensor
StateDict = dict[str, Tensor]


def sizes_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig sizes every BERT-style Hugging Face config names alike (`num_hidden_layers`...)."""
    return {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": c["num_attention_heads"],
        "ffn_hidden_size": c["intermediate_size"],
        "seq_length": c["max_position_embeddings"],
        "max_position_embeddings": c["max_position_embeddings"],
    }


def yarn_values(rope: dict[str, Any]) -> dict[str, Any]:
    """The YaRN ModelConfig values of a Hugging Face `rope_parameters` (or `rope_scaling`) dict."""
    return {
        "rotary_scaling_factor": rope["factor"],
        "yarn_original_max_position_embeddings": rope["original_max_position_embeddings"],
        "yarn_beta_fast": rope.get("beta_fast", 32.0),
        "yarn_beta_slow": rope.get("beta_slow", 1.0),
        "yarn_correction_range_round_to_int": rope.get("truncate", True),
    }


def export_ends(
    sd: StateDict, vocab_size: int, embedding: str, final_norm: str, clone: bool
) -> StateDict:
    """The Hugging Face word embedding, final norm and `lm_head.weight` (the embedding when the
    output layer is tied) of a gigatron state dict, padding rows dropped; `clone`: copies."""
    copy = torch.clone if clone else (lambda tensor: tensor)
    embed = copy(sd["embedding.word_embeddings.weight"][:vocab_size])
    head = sd.get("output_layer.weight")
    return {
        embedding: embed,
        final_norm: copy(sd["decoder.final_layernorm.weight"]),
        "lm_head.weight": embed if head is None else copy(head[:vocab_size]),
    }


def model_config_from_hf(hf_config: Any) -> dict[str, Any]:
    """gigatron ModelConfig values (plus `vocab_size`) for a Hugging Face GPT-2 or Llama config
    (a PretrainedConfig or its dict)."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    model_type = c.get("model_type")
    if model_type == "gpt2":
        return {
            "num_layers": c["n_layer"],
            "hidden_size": c["n_embd"],
            "num_attention_heads": c["n_head"],
            "ffn_hidden_size": c.get("n_inner") or 4 * c["n_embd"],
            "seq_length": c["n_positions"],
            "max_position_embeddings": c["n_positions"],
            "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm",
            "layernorm_epsilon": c.get("layer_norm_epsilon", 1e-5),
            "openai_gelu": c.get("activation_function", "gelu_new")
            in ("gelu_new", "gelu_pytorch_tanh"),
            "add_bias_linear": True,
            "untie_embeddings_and_output_weights": False,
            "vocab_size": c["vocab_size"],
        }
    if model_type in ("llama", "mistral"):
        return llama_like_values(c)
    raise GigatronError(
        f"Hugging Face model_type {model_type!r} is not supported; supported: gpt2, llama, mistral"
    )


def llama_like_values(c: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig values (plus `vocab_size`) that every Llama-style config.json (Llama,
    Mistral, Qwen2, Mixtral, Qwen2-MoE) gives the same way: grouped-query attention, RoPE,
    RMSNorm, SwiGLU, no linear biases."""
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    groups = c.get("num_key_value_heads") or heads
    positions = c.get("max_position_embeddings", 4096)
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000)
    return {
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
        "rotary_base": int(rope),
        "normalization": "RMSNorm",
        "layernorm_epsilon": c.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
        "vocab_size": c["vocab_size"],
    }


def pad_rows(weight: Tensor, rows: int) -> Tensor:
    if weight.shape[0] > rows:
        raise GigatronError(
            f"the checkpoint's vocabulary ({weight.shape[0]}) exceeds the padded vocabulary "
            f"{rows}; raise --padded-vocab-size"
        )
    if weight.shape[0] == rows:
        return weight.clone()
    pad = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_query_groups: int) -> Tensor:
    """[np*hn, ...], [ng*hn, ...], [ng*hn, ...] -> gigatron's [ng * (np/ng + 2) * hn, ...]."""
    ng = num_query_groups
    rest = q.shape[1:]
    parts = [t.reshape(ng, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: Tensor, num_heads: int, num_query_groups: int, kv_channels: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`."""
    ng, hn = num_query_groups, kv_channels
    per_group_q = num_heads // ng * hn
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, per_group_q + 2 * hn, *rest)
    q, k, v = grouped.split([per_group_q, hn, hn], dim=1)
    return (
        q.reshape(-1, *rest).clone(),
        k.reshape(-1, *rest).clone(),
        v.reshape(-1, *rest).clone(),
    )


# ---------------------------------------------------------------- GPT-2 ------------------------
def gpt2_to_gigatron(
    hf: StateDict, num_layers: int, num_heads: int, padded_vocab_size: int
) -> StateDict:
    """GPT2LMHeadModel state dict -> gigatron GPT state dict (tied embeddings)."""
    out: StateDict = {
        "embedding.word_embeddings.weight": pad_rows(
            hf["transformer.wte.weight"], padded_vocab_size
        ),
        "embedding.position_embeddings.weight": hf["transformer.wpe.weight"].clone(),
        "decoder.final_layernorm.weight": hf["transformer.ln_f.weight"].clone(),
        "decoder.final_layernorm.bias": hf["transformer.ln_f.bias"].clone(),
    }
    for i in range(num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for hf_name, name in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[dst + name + ".weight"] = hf[src + hf_name + ".weight"].clone()
            out[dst + name + ".bias"] = hf[src + hf_name + ".bias"].clone()
        qkv_w = hf[src + "attn.c_attn.weight"].t()
        qkv_b = hf[src + "attn.c_attn.bias"]
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv_w.chunk(3, dim=0), num_heads)
        out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(*qkv_b.chunk(3, dim=0), num_heads)
        for hf_name, name in (
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        ):
            out[dst + name + ".weight"] = hf[src + hf_name + ".weight"].t().contiguous()
            out[dst + name + ".bias"] = hf[src + hf_name + ".bias"].clone()
    return out


def gigatron_to_gpt2(sd: StateDict, num_layers: int, num_heads: int, vocab_size: int) -> StateDict:
    """gigatron GPT state dict (GPT-2 shaped) -> GPT2LMHeadModel state dict."""
    wte = sd["embedding.word_embeddings.weight"][:vocab_size].clone()
    out: StateDict = {
        "transformer.wte.weight": wte,
        "transformer.wpe.weight": sd["embedding.position_embeddings.weight"].clone(),
        "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"].clone(),
        "transformer.ln_f.bias": sd["decoder.final_layernorm.bias"].clone(),
        "lm_head.weight": wte,
    }
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for hf_name, name in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[dst + hf_name + ".weight"] = sd[src + name + ".weight"].clone()
            out[dst + hf_name + ".bias"] = sd[src + name + ".bias"].clone()
        w = sd[src + "self_attention.linear_qkv.weight"]
        hn = w.shape[1] // num_heads
        out[dst + "attn.c_attn.weight"] = torch.cat(split_qkv(w, num_heads, num_heads, hn)).t()
        b = sd[src + "self_attention.linear_qkv.bias"]
        out[dst + "attn.c_attn.bias"] = torch.cat(split_qkv(b, num_heads, num_heads, hn))
        for hf_name, name in (
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        ):
            out[dst + hf_name + ".weight"] = sd[src + name + ".weight"].t().contiguous()
            out[dst + hf_name + ".bias"] = sd[src + name + ".bias"].clone()
    return out


# ---------------------------------------------------------------- Llama ------------------------
def llama_to_gigatron(
    hf: StateDict,
    num_layers: int,
    num_heads: int,
    num_query_groups: int,
    padded_vocab_size: int,
    tied: bool = False,
) -> StateDict:
    """LlamaForCausalLM (or Mistral) state dict -> gigatron GPT state dict."""
    out: StateDict = {
        "embedding.word_embeddings.weight": pad_rows(
            hf["model.embed_tokens.weight"], padded_vocab_size
        ),
        "decoder.final_layernorm.weight": hf["model.norm.weight"].clone(),
    }
    if not tied:
        out["output_layer.weight"] = pad_rows(hf["lm_head.weight"], padded_vocab_size)
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[src + "self_attn.q_proj.weight"],
            hf[src + "self_attn.k_proj.weight"],
            hf[src + "self_attn.v_proj.weight"],
            num_query_groups,
        )
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"].clone()
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"].clone()
    return out


def gigatron_to_llama(
    sd: StateDict,
    num_layers: int,
    num_heads: int,
    num_query_groups: int,
    kv_channels: int,
    vocab_size: int,
) -> StateDict:
    """gigatron GPT state dict (Llama shaped) -> LlamaForCausalLM state dict."""
    out = export_ends(sd, vocab_size, "model.embed_tokens.weight", "model.norm.weight", True)
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"].clone()
        q, k, v = split_qkv(
            sd[src + "self_attention.linear_qkv.weight"], num_heads, num_query_groups, kv_channels
        )
        out[dst + "self_attn.q_proj.weight"] = q
        out[dst + "self_attn.k_proj.weight"] = k
        out[dst + "self_attn.v_proj.weight"] = v
        out[dst + "self_attn.o_proj.weight"] = sd[src + "self_attention.linear_proj.weight"].clone()
        gate, up = sd[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.clone()
        out[dst + "mlp.up_proj.weight"] = up.clone()
        out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.linear_fc2.weight"].clone()
    return out
