"""`--torch-compile`: each transformer layer's forward compiled by torch.compile (inductor).

Layers are compiled one by one, not the whole model: every layer of a block has the same code
and shapes, so one compiled graph serves them all (dynamo guards on the layer's attributes, not on
its weights), compilation stays quick, and what runs between layers stays eager: activation
recompute, pipeline send/recv, the data-parallel hooks. The compiled function replaces the
layer's `forward` on the instance, so module hooks (FSDP2's unshard/reshard, DDP's parameter
gather) run around it, outside the graph, and the state dict keeps its names.

MoE layers trace into one graph too: their routing-dependent sizes (the token permutation's
`nonzero`, the per-expert split sizes) are traced as symbolic sizes (`compile_settings`), and
the router counts its statistics through an operator, not a Python branch (moe/aux_loss.py).
"""

from __future__ import annotations

import contextlib
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
        layer.forward = compile_settings()(torch.compile(layer.forward, backend=backend))
    return len(layers)


def compile_settings() -> contextlib.AbstractContextManager:
    """Dynamo's settings a layer is traced under (a context manager, also a decorator): sizes
    read from tensors (`.tolist()`) and operators whose output size depends on the data
    (`nonzero`) become symbolic sizes in the graph instead of graph breaks (MoE's dispatch)."""
    return torch._dynamo.config.patch(
        capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True
    )
