"""MoESpec: the resolved Mixture-of-Experts options the MoE modules read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gigatron.config.moe import moe_layer_pattern
from gigatron.errors import GigatronError

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class MoESpec:
    """Megatron's MoE flags with their derived defaults (see config/moe.py for each meaning)."""

    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    router_dtype: torch.dtype | None = None
    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    input_jitter_eps: float | None = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    dispatcher: str = "allgather"
    grouped_gemm: bool = False
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False
    per_layer_logging: bool = False
    per_token_loss: bool = False
    layer_pattern: tuple[bool, ...] = ()

    @classmethod
    def from_config(cls, cfg) -> MoESpec | None:
        """None for a dense model (no --num-experts)."""
        e = cfg.moe
        if not e.num_experts:
            return None
        m = cfg.model
        ffn = e.moe_ffn_hidden_size or m.ffn_hidden_size
        if ffn is None:
            raise GigatronError("--moe-ffn-hidden-size (or --ffn-hidden-size) is needed with MoE")
        return cls(
            num_experts=e.num_experts,
            ffn_hidden_size=ffn,
            topk=e.moe_router_topk,
            score_function=e.moe_router_score_function,
            pre_softmax=e.moe_router_pre_softmax,
            topk_scaling_factor=e.moe_router_topk_scaling_factor,
            num_groups=e.moe_router_num_groups,
            group_topk=e.moe_router_group_topk,
            router_dtype=ROUTER_DTYPES.get(e.moe_router_dtype) if e.moe_router_dtype else None,
            load_balancing_type=e.moe_router_load_balancing_type,
            aux_loss_coeff=e.moe_aux_loss_coeff,
            z_loss_coeff=e.moe_z_loss_coeff,
            input_jitter_eps=e.moe_input_jitter_eps,
            enable_expert_bias=e.moe_router_enable_expert_bias,
            bias_update_rate=e.moe_router_bias_update_rate,
            dispatcher=e.moe_token_dispatcher_type,
            grouped_gemm=e.moe_grouped_gemm,
            capacity_factor=e.moe_expert_capacity_factor,
            drop_policy=e.moe_token_drop_policy,
            pad_to_capacity=e.moe_pad_expert_input_to_capacity,
            shared_expert_size=e.moe_shared_expert_intermediate_size,
            shared_expert_gate=e.moe_shared_expert_gate,
            per_layer_logging=e.moe_per_layer_logging,
            per_token_loss=cfg.parallel.calculate_per_token_loss,
            layer_pattern=_with_mtp_layers(
                moe_layer_pattern(e.moe_layer_freq, m.num_layers), m.mtp_num_layers
            ),
        )

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the layer with 1-based global `layer_number` is an MoE layer."""
        return self.layer_pattern[layer_number - 1]

    @property
    def moe_layer_numbers(self) -> list[int]:
        """1-based global numbers of the MoE layers."""
        return [i + 1 for i, moe in enumerate(self.layer_pattern) if moe]

    @property
    def aux_loss_name(self) -> str | None:
        """The report name of the load-balancing loss in use (Megatron's names), if any."""
        if self.aux_loss_coeff <= 0:
            return None
        return {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}.get(
            self.load_balancing_type
        )


def _with_mtp_layers(pattern: list[bool], mtp_num_layers: int | None) -> tuple[bool, ...]:
    """The decoder's pattern, then one entry per multi-token prediction layer (numbered after
    the decoder's layers), each like the decoder's last layer."""
    return tuple(pattern) + tuple(pattern[-1:]) * (mtp_num_layers or 0)
