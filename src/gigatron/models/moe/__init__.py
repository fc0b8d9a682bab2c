"""Mixture of Experts: router, token dispatchers, grouped experts, shared experts, the MoE layer,
and how their auxiliary losses get gradients and reach the logs (see docs/moe.md)."""

from gigatron.models.moe.layer import MoELayer, moe_layer_parts
from gigatron.models.moe.reports import collect_moe_reports, report_names
from gigatron.models.moe.router import TopKRouter, update_expert_bias
from gigatron.models.moe.spec import MoESpec

__all__ = [
    "MoELayer",
    "MoESpec",
    "TopKRouter",
    "collect_moe_reports",
    "moe_layer_parts",
    "report_names",
    "update_expert_bias",
]
