"""Writes tests/data/megatron-fixtures/legacy-*: tiny checkpoints in Megatron-LM's legacy
model-class layout (`megatron.legacy.model`, the layout of the NGC GPT-345M and BERT-345M
downloads), made by renaming and reordering Megatron-Core-layout checkpoints:

- legacy-gpt: Megatron-LM's own gpt2_tp1_torch fixture (weights of iteration 3), as the oldest
  legacy layout: nested dictionaries, `language_model.transformer.layers.N.attention.*`,
  `checkpoint_version` 0 (fused QKV rows [3, heads, head dim]); fixture.json is gpt2_tp1_torch's.
- legacy-bert-core: a gigatron BERT (2 layers, hidden 32, seeded random weights) in
  Megatron-Core's names (`pooler.dense.*`), torch format;
- legacy-bert: the same weights in the later legacy layout: `language_model.encoder.layers.N.
  self_attention.*`, `lm_head.layernorm`, `checkpoint_version` 1 (QKV rows [heads, head dim, 3]).

    PYTHONPATH=src python tests/tools/make_legacy_fixtures.py [OUT]

Needs only gigatron (and torch); the files are release checkpoints (`release/mp_rank_00`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from gigatron.torch_files import load_megatron_file

HERE = Path(__file__).resolve().parents[1] / "data" / "megatron-fixtures"
# Megatron-Core layer name -> legacy (inside `layers.N.`); `attention` is the older spelling
CORE_TO_LEGACY = {
    "self_attention.linear_qkv.": "self_attention.query_key_value.",
    "self_attention.linear_proj.": "self_attention.dense.",
    "input_layernorm.": "input_layernorm.",
    "pre_mlp_layernorm.": "post_attention_layernorm.",
    "mlp.linear_fc1.": "mlp.dense_h_to_4h.",
    "mlp.linear_fc2.": "mlp.dense_4h_to_h.",
}
HEADS = {
    "pooler.dense.": ("language_model", "pooler", "dense."),
    "lm_head.dense.": ("lm_head", "dense."),
    "lm_head.layer_norm.": ("lm_head", "layernorm."),
    "binary_head.": ("binary_head", ""),
}


def to_version(tensor: torch.Tensor, version: int, heads: int) -> torch.Tensor:
    """Core QKV rows [heads, 3, head dim] in the order of `checkpoint_version` 0 or 1."""
    rest = tuple(tensor.shape[1:])
    head_dim = tensor.shape[0] // (3 * heads)
    grouped = tensor.reshape(heads, 3, head_dim, *rest)
    order = grouped.transpose(0, 1) if version == 0 else grouped.transpose(1, 2)
    return order.reshape(tensor.shape).clone()


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _layer_name(inner: str, old_names: bool) -> str:
    for core, legacy in CORE_TO_LEGACY.items():
        if inner.startswith(core):
            name = legacy + inner[len(core) :]
            return name.replace("self_attention.", "attention.", 1) if old_names else name
    raise KeyError(inner)


def core_to_legacy(model: dict[str, Any], version: int, heads: int, old_names: bool) -> dict:
    """A Megatron-Core model state as a legacy nested one (`old_names`: `transformer` and
    `attention`, else `encoder` and `self_attention`)."""
    tree: dict = {}
    block = "transformer" if old_names else "encoder"
    for name, tensor in model.items():
        if name.endswith("_extra_state"):
            continue
        if name.startswith("embedding."):
            module, param = name[len("embedding.") :].split(".", 1)
            _put(tree, ("language_model", "embedding", module, param), tensor)
        elif name.startswith(("decoder.", "encoder.")):
            inner = name.split(".", 1)[1]
            if inner.startswith("layers."):
                _, number, rest = inner.split(".", 2)
                if ".linear_qkv." in rest and version < 2:
                    tensor = to_version(tensor, version, heads)
                inner = f"layers.{number}.{_layer_name(rest, old_names)}"
            _put(tree, ("language_model", block, inner), tensor)
        elif name == "output_layer.bias":
            _put(tree, ("lm_head", "bias"), tensor)
        elif name == "output_layer.weight":
            _put(tree, ("language_model", "output_layer", "weight"), tensor)
        else:
            prefix = next(p for p in HEADS if name.startswith(p))
            *path, head = HEADS[prefix]
            _put(tree, (*path, head + name[len(prefix) :]), tensor)
    return tree


def plain_args(args: argparse.Namespace) -> argparse.Namespace:
    """The saved arguments without Megatron's enum values (kept inert by gigatron's reader)."""
    plain = (int, float, str, bool, type(None), list, tuple, torch.dtype)
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if isinstance(v, plain)})


def write_release(out: Path, state: dict[str, Any]) -> None:
    shutil.rmtree(out, ignore_errors=True)
    (out / "release" / "mp_rank_00").mkdir(parents=True)
    torch.save(state, out / "release" / "mp_rank_00" / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("release")


def make_gpt(out: Path) -> None:
    source = HERE / "gpt2_tp1_torch"
    state = load_megatron_file(source / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    args = plain_args(state["args"])
    model = core_to_legacy(state["model"], 0, args.num_attention_heads, old_names=True)
    write_release(out / "legacy-gpt", {"args": args, "model": model, "iteration": 0})
    shutil.copy(source / "fixture.json", out / "legacy-gpt" / "fixture.json")


def bert_core_state() -> tuple[argparse.Namespace, dict[str, torch.Tensor]]:
    """A tiny gigatron BERT's weights in Megatron-Core's names, and Megatron-style args."""
    from gigatron.checkpoint.megatron_convert import megatron_args  # why: gigatron only here
    from gigatron.config import parse_config
    from gigatron.config.root import config_to_dict
    from gigatron.models.bert import build_bert_model
    from gigatron.parallel.context import ParallelContext

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "64",
            "--make-vocab-size-divisible-by", "32", "--init-method-std", "0.05"]  # fmt: skip
    cfg = parse_config(argv)
    torch.manual_seed(25)
    (model,) = build_bert_model(cfg, ParallelContext.single(), vocab_size=64)
    with torch.no_grad():  # random biases and norms, so the map of every tensor is checked
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(0.0, 0.1)
    state = {}
    for name, tensor in model.state_dict().items():
        if not name.endswith("_extra_state"):
            name = "pooler.dense." + name[len("pooler.") :] if name.startswith("pooler.") else name
            state[name] = tensor.clone()
    args = megatron_args(config_to_dict(cfg), {"iteration": 0, "model": state})
    return plain_args(args), state


def make_bert(out: Path) -> None:
    args, core = bert_core_state()
    write_release(out / "legacy-bert-core", {"args": args, "model": core, "iteration": 0,
                                             "checkpoint_version": 3.0})  # fmt: skip
    model = core_to_legacy(core, 1, args.num_attention_heads, old_names=False)
    legacy = {"args": args, "model": model, "iteration": 0, "checkpoint_version": 1.0}
    write_release(out / "legacy-bert", legacy)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    make_gpt(target)
    make_bert(target)
