"""The MoE layer: a drop-in for the transformer layer's MLP, `forward(x [s, b, h]) -> [s, b, h]`
in the layer's tensor/sequence-parallel layout.

Tokens: each tensor-parallel rank routes its own slice of the sequence (with sequence
parallelism it already holds only that slice; without, the layer takes it here and all-gathers
the output at the end). The slice's tokens go through the router, the dispatcher (to the ranks
holding their experts and back) and the experts; the shared experts, if any, run on the layer's
input like a dense MLP and are added.

Parameter names: `router.weight` (+ buffer `router.expert_bias`), `experts.linear_fc1.weight`,
`experts.linear_fc2.weight`, `shared_experts.linear_fc1.weight`, `shared_experts.linear_fc2.weight`,
`shared_experts.gate_weight`; with `add_bias_linear` (Megatron's default; off with
`--disable-bias-linear`) also `router.bias`, `experts.linear_fc1.bias`, `experts.linear_fc2.bias`
and the shared experts' `linear_fc1.bias`, `linear_fc2.bias`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.models.activations import mlp_activation
from gigatron.models.moe.dispatcher import build_dispatcher
from gigatron.models.moe.experts import GroupedExperts
from gigatron.models.moe.router import TopKRouter
from gigatron.models.moe.shared_experts import SharedExpertMLP
from gigatron.models.moe.spec import MoESpec
from gigatron.models.transformer import MLP, LayerParts, selective_recompute_modules
from gigatron.parallel.collectives import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import recompute


class MoELayer(nn.Module):
    """Router + token dispatcher + experts (+ shared experts); see the module docstring."""

    def __init__(self, spec, moe: MoESpec, pctx: ParallelContext, layer_number: int) -> None:
        super().__init__()
        ep = pctx.size("ep")
        if moe.num_experts % ep:
            raise GigatronError(
                f"--num-experts {moe.num_experts} is not divisible by the expert-parallel size "
                f"{ep}; change one of them"
            )
        self.pctx = pctx
        self.layer_number = layer_number
        self.split_sequence = pctx.tp_size > 1 and not spec.sequence_parallel
        self.router = TopKRouter(
            moe,
            spec.hidden_size,
            pctx,
            layer_number,
            spec.init_method_std,
            spec.params_dtype,
            bias=spec.add_bias_linear,
        )
        self.dispatcher = build_dispatcher(moe.dispatcher, moe.num_experts, pctx)
        self.experts = GroupedExperts(
            moe.num_experts // ep,
            spec.hidden_size,
            moe.ffn_hidden_size,
            pctx,
            swiglu=spec.gated_linear_unit,
            openai_gelu=spec.openai_gelu,
            init_std=spec.init_method_std,
            output_init_std=spec.output_init_std,
            params_dtype=spec.params_dtype,
            grouped_gemm=moe.grouped_gemm,
            activation=mlp_activation(spec),
            bias=spec.add_bias_linear,
            recompute_activation="moe_act" in selective_recompute_modules(spec),
        )
        self.recompute_shared = "shared_experts" in selective_recompute_modules(spec)
        self.shared_experts = (
            SharedExpertMLP(spec, pctx, moe.shared_expert_size, moe.shared_expert_gate)
            if moe.shared_expert_size
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = scatter_to_sequence_parallel_region(x, self.pctx) if self.split_sequence else x
        seq, batch, hidden = local.shape
        tokens = local.reshape(seq * batch, hidden)
        probs, routing_map = self.router(tokens, batch)
        expert_input, tokens_per_expert, handle = self.dispatcher.dispatch(
            tokens, probs, routing_map, self.router.routed_copies(tokens.shape[0])
        )
        expert_output = self.experts(expert_input, tokens_per_expert)
        out = self.dispatcher.combine(expert_output, handle).view(seq, batch, hidden)
        if self.split_sequence:
            # Every tp rank continues with the whole sequence; the backward keeps its slice.
            out = gather_from_sequence_parallel_region(out, self.pctx, reduce_grads=False)
        if self.shared_experts is not None:
            recomputed = self.recompute_shared and self.training and torch.is_grad_enabled()
            shared = recompute(self.shared_experts, x) if recomputed else self.shared_experts(x)
            out = out + shared
        return out


def moe_layer_parts(cfg, parts: LayerParts | None = None) -> LayerParts | None:
    """`parts` (default: the standard ones) with MoE layers as the MLP of the layers
    `--moe-layer-freq` selects; `parts` unchanged for a dense model (no --num-experts)."""
    moe = MoESpec.from_config(cfg)
    if moe is None:
        return parts
    parts = parts or LayerParts()
    dense_mlp = parts.mlp if parts.mlp is not None else MLP

    def mlp(config, pctx: ParallelContext, layer_number: int, rng=None) -> nn.Module:
        if moe.is_moe_layer(layer_number):
            return MoELayer(config, moe, pctx, layer_number)
        return dense_mlp(config, pctx, layer_number, rng)

    return dataclasses.replace(parts, mlp=mlp)
