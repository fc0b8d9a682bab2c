"""Shared experts (DeepSeek, Qwen-MoE): a dense MLP every token goes through, next to the routed
experts; optionally scaled by a learned per-token gate, sigmoid(x . gate_weight) (Qwen-MoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.models.transformer import MLP
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import set_tensor_parallel_attributes


class SharedExpertMLP(MLP):
    """`forward(x [s, b, h]) -> [s, b, h]` in the layer's (tensor/sequence-parallel) layout.

    Parameters: `linear_fc1.weight`, `linear_fc2.weight` (the dense MLP's, Megatron's names:
    mlp.shared_experts.linear_fc1.weight, ...) and, with the gate, `gate_weight` [1, h]
    (replicated over tp; sequence-parallel like a norm weight).
    """

    def __init__(self, spec, pctx: ParallelContext, ffn_hidden_size: int, gate: bool) -> None:
        super().__init__(spec, pctx, ffn_hidden_size=ffn_hidden_size)
        if gate:
            self.gate_weight = nn.Parameter(
                torch.empty(1, spec.hidden_size, dtype=spec.params_dtype, device=pctx.device)
            )
            set_tensor_parallel_attributes(
                self.gate_weight, False, init="normal", init_std=spec.init_method_std
            )
            self.gate_weight.sequence_parallel = spec.sequence_parallel
        else:
            self.gate_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out
