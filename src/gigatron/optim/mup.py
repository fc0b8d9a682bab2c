"""µP's per-layer learning rates (`--use-mup`, Megatron's rules; docs/mup.md).

With m = the width multiplier (models/mup.py): under Adam the hidden matrices (every 2-D weight
but the embeddings and the output layer) take lr / m and eps / m; under SGD the vector-like
parameters (embeddings, output layer, biases and norms) take lr * m. Groups with
--decoupled-lr keep their explicit rate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from gigatron.models.mup import width_mult

# Parameters µP treats as vector-like although they are matrices (their fan-in does not grow
# with the width): the embeddings and the output layer.
EMBEDDING_NAMES = ("embeddings.weight", "output_layer.weight")


def _embedding_ids(model_chunks: Iterable[nn.Module]) -> set[int]:
    return {
        id(param)
        for chunk in model_chunks
        for name, param in chunk.named_parameters()
        if name.endswith(EMBEDDING_NAMES)
    }


def mup_param_groups(
    cfg: Any, groups: list[dict[str, Any]], model_chunks: list[nn.Module]
) -> list[dict[str, Any]]:
    """`groups` (optim.optimizer.get_param_groups) with µP's learning rates; unchanged without
    --use-mup or at the base width."""
    mult = width_mult(cfg.model)
    if mult == 1.0:
        return groups
    embeddings = _embedding_ids(model_chunks)
    sgd = cfg.optimizer.optimizer == "sgd"
    out = []
    for group in groups:
        if "max_lr" in group:  # --decoupled-lr: an explicit rate
            out.append(group)
            continue
        hidden = [p for p in group["params"] if p.dim() >= 2 and id(p) not in embeddings]
        vector = [p for p in group["params"] if p.dim() < 2 or id(p) in embeddings]
        if vector:
            out.append({**group, "params": vector, "lr_mult": mult if sgd else 1.0})
        if hidden and sgd:
            out.append({**group, "params": hidden})
        elif hidden:
            eps = cfg.optimizer.adam_eps / mult
            out.append({**group, "params": hidden, "lr_mult": 1.0 / mult, "eps": eps})
    return out
