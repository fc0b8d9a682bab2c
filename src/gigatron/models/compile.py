"""`--torch-compile`: each transformer layer's forward compiled by torch.compile (inductor).

Layers are compiled one by one, not the whole model: every layer of a block has the same code
and shapes, so one compiled graph serves them all (dynamo guards on the layer's attributes, not on
its weights), compilation stays quick, and what runs between layers stays eager: activation
recompute, pipeline send/recv, the data-parallel hooks. The compiled function replaces the
layer's `forward` on the instance, so module hooks (FSDP2's unshard/reshard, DDP's parameter
gather) run around it, outside the graph, and the state dict keeps its names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from gigatron.models.transformer import TransformerBlock


def transformer_layers(chunks: Iterable[nn.Module]) -> list[nn.Module]:
    """Every layer of every TransformerBlock in the chunks (GPT, BERT, T5, hybrid and MoE)."""
    return [
        layer
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(module, TransformerBlock)
        for layer in module.layers.values()
    ]


def compile_layers(chunks: Iterable[nn.Module], backend: str | Callable = "inductor") -> int:
    """Compile the forward of every transformer layer of the chunks in place; the number of
    layers compiled. `backend` is torch.compile's (tests use cheaper ones where they say why)."""
    layers = transformer_layers(chunks)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)
