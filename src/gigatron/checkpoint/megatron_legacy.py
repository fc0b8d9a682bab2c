"""Megatron-LM's legacy model-class checkpoints (`megatron.legacy.model`: the layout of the NGC
GPT-345M and BERT-345M downloads) renamed to Megatron-Core's names, so the core-layout reader
(megatron_format.py) takes them from there.

A legacy file keeps its model as nested dictionaries (`language_model` -> `embedding` ->
`word_embeddings` -> `weight`) or as dotted names; the transformer is under `encoder` (older:
`transformer`), its attention under `self_attention` (older: `attention`). The fused QKV rows
of `checkpoint_version` 0 are ordered [3, heads, head dim], of version 1 [heads, head dim, 3];
from version 2 on they are [heads, 3, head dim], Megatron-Core's order (what Megatron's
`fix_query_key_value_ordering` does on load).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gigatron.errors import GigatronError

_EMBEDDING = "language_model.embedding."
_TRANSFORMERS = ("language_model.encoder.", "language_model.transformer.")
# legacy layer name -> Megatron-Core's (inside `layers.N.`)
_LAYER_NAMES = {
    "attention.query_key_value.": "self_attention.linear_qkv.",
    "self_attention.query_key_value.": "self_attention.linear_qkv.",
    "attention.dense.": "self_attention.linear_proj.",
    "self_attention.dense.": "self_attention.linear_proj.",
    "input_layernorm.": "input_layernorm.",
    "post_attention_layernorm.": "pre_mlp_layernorm.",
    "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
    "mlp.dense_4h_to_h.": "mlp.linear_fc2.",
}
_HEADS = {
    "language_model.pooler.dense.": "pooler.dense.",
    "language_model.output_layer.": "output_layer.",
    "lm_head.dense.": "lm_head.dense.",
    "lm_head.layernorm.": "lm_head.layer_norm.",
    "binary_head.": "binary_head.",
}
_WHOLE = {
    "lm_head.bias": "output_layer.bias",
    "word_embeddings_for_head.weight": "output_layer.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def flatten(model: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested state dictionaries as one with dotted names."""
    out: dict[str, Any] = {}
    for key, value in model.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def is_legacy_model(model: Any) -> bool:
    """Whether a checkpoint's `model` entry is in the legacy model-class layout."""
    return isinstance(model, dict) and any(
        str(key) == "language_model" or str(key).startswith("language_model.") for key in model
    )


def _transformer_name(rest: str, block: str) -> str | None:
    match = _LAYER.match(rest)
    if match is None:
        return f"{block}.{rest}" if rest.startswith("final_layernorm.") else None
    number, inner = match.groups()
    for legacy, core in _LAYER_NAMES.items():
        if inner.startswith(legacy):
            return f"{block}.layers.{number}.{core}{inner[len(legacy) :]}"
    return None


def core_name(name: str, block: str) -> str | None:
    """Megatron-Core's name of a legacy entry (None: not a known weight); `block` is `decoder`
    (GPT) or `encoder` (BERT)."""
    if name in _WHOLE:
        return _WHOLE[name]
    if name.startswith(_EMBEDDING):
        return "embedding." + name[len(_EMBEDDING) :]
    for prefix in _TRANSFORMERS:
        if name.startswith(prefix):
            return _transformer_name(name[len(prefix) :], block)
    for legacy, core in _HEADS.items():
        if name.startswith(legacy):
            return core + name[len(legacy) :]
    return None


def reorder_qkv(tensor: torch.Tensor, version: float, head_dim: int) -> torch.Tensor:
    """Fused QKV rows (weight or bias) of `checkpoint_version` `version` in [heads, 3, head dim]
    order (the heads of this tensor-parallel rank)."""
    if version >= 2:
        return tensor
    rest = tuple(tensor.shape[1:])
    heads = tensor.shape[0] // (3 * head_dim)
    if version == 0:
        return tensor.view(3, heads, head_dim, *rest).transpose(0, 1).reshape(tensor.shape)
    if version == 1:
        return tensor.view(heads, head_dim, 3, *rest).transpose(1, 2).reshape(tensor.shape)
    raise GigatronError(f"checkpoint_version {version}: not a Megatron-LM checkpoint version")


def legacy_to_core(model: dict[str, Any], version: float, head_dim: int | None) -> dict[str, Any]:
    """A legacy model state (nested or dotted) with Megatron-Core's names and QKV order
    (`head_dim`, the attention head size, is needed below version 2)."""
    flat = flatten(model)
    block = (
        "encoder" if any(k.startswith(("lm_head.", "binary_head.")) for k in flat) else "decoder"
    )
    out: dict[str, Any] = {}
    unknown = []
    for name, tensor in flat.items():
        if name.endswith(("_extra_state", ".inv_freq")):
            continue
        target = core_name(name, block)
        if target is None:
            unknown.append(name)
            continue
        if ".linear_qkv." in target and version < 2:
            if not head_dim:
                raise GigatronError(
                    f"{name}: checkpoint_version {version} needs the attention head size to "
                    "reorder its QKV rows, and the file saved no args; give the model flags "
                    "(--num-attention-heads, --hidden-size or --kv-channels)"
                )
            tensor = reorder_qkv(tensor, version, head_dim)
        out[target] = tensor
    if unknown:
        raise GigatronError(
            f"the legacy Megatron-LM checkpoint holds {', '.join(unknown[:4])}, which gigatron "
            "does not know (an architecture it lacks); convert it with Megatron-LM's own "
            "converter (--loader legacy --saver core) first"
        )
    return out


def _head_dim(args: dict[str, Any]) -> int | None:
    if args.get("kv_channels"):
        return int(args["kv_channels"])
    if args.get("hidden_size") and args.get("num_attention_heads"):
        return int(args["hidden_size"]) // int(args["num_attention_heads"])
    return None


def core_state(state: dict[str, Any], head_dim: int | None = None) -> dict[str, Any]:
    """A Megatron-LM file's content with every legacy `model*` entry in Megatron-Core's layout
    (the file itself when it has none); `head_dim`: the attention head size when the file saved
    no args (older NGC downloads)."""
    keys = [k for k in state if re.fullmatch(r"model\d*", str(k)) and is_legacy_model(state[k])]
    if not keys:
        return state
    args = vars(state["args"]) if state.get("args") is not None else {}
    version = float(state.get("checkpoint_version", 0) or 0)
    out = dict(state)
    for key in keys:
        out[key] = legacy_to_core(state[key], version, _head_dim(args) or head_dim)
    return out
