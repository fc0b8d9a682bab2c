"""Mixture-of-Experts options (Megatron's `moe` and MoE transformer flags).

The expert-parallel layout (`--expert-model-parallel-size`, `--expert-tensor-parallel-size`)
lives with the other parallel sizes in config/parallel.py.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field
from gigatron.config.rules import Section
from gigatron.errors import GigatronError


@dataclass
class MoEConfig(Section):
    num_experts: Optional[int] = flag_field(None, "experts per MoE layer (None: dense MLPs)")
    moe_layer_freq: str = flag_field(
        "1",
        "which layers are MoE: an integer N (layer i is MoE when i % N == 0) or a list pattern "
        "such as '[1,0,1,1]' or '([1]*3+[0])*2' (1 = MoE, one entry per layer)",
    )
    moe_ffn_hidden_size: Optional[int] = flag_field(None, "hidden size of each expert's MLP; default --ffn-hidden-size")
    moe_shared_expert_intermediate_size: Optional[int] = flag_field(
        None, "hidden size of the shared expert (all shared experts together); None: none"
    )
    moe_shared_expert_gate: bool = flag_field(
        False, "scale the shared expert's output by sigmoid(x . gate) (Qwen-MoE style)"
    )
    moe_router_topk: int = flag_field(2, "experts each token is routed to")
    moe_use_upcycling: bool = flag_field(
        False, "start from the dense checkpoint under --load, each expert a copy of its MLP"
    )
    moe_upcycling_granularity: int = flag_field(1, "how many times smaller an expert is than the dense MLP (only 1)")
    moe_router_score_function: str = flag_field(
        "softmax", "router score function", choices=["softmax", "sigmoid", "sqrtsoftplus"]
    )
    moe_router_pre_softmax: bool = flag_field(
        False, "softmax over all experts before the top-k (else over the top-k logits)"
    )
    moe_router_topk_scaling_factor: Optional[float] = flag_field(
        None, "multiply the top-k routing probabilities by this factor"
    )
    moe_router_num_groups: Optional[int] = flag_field(None, "expert groups for group-limited routing")
    moe_router_group_topk: Optional[int] = flag_field(
        None, "groups each token may be routed to (group-limited routing)"
    )
    moe_router_dtype: Optional[str] = flag_field(
        None, "precision of the router's logits and scores", choices=["fp32", "fp64"]
    )
    moe_router_load_balancing_type: str = flag_field(
        "aux_loss",
        "load balancing: aux_loss (GShard/Switch), seq_aux_loss (per sequence, DeepSeek-V2), sinkhorn (S-BASE) or none",
        choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
    )
    moe_aux_loss_coeff: float = flag_field(0.0, "weight of the load-balancing loss (e.g. 1e-2)")
    moe_z_loss_coeff: Optional[float] = flag_field(None, "weight of the router z-loss (ST-MoE; e.g. 1e-3)")
    moe_input_jitter_eps: Optional[float] = flag_field(
        None, "multiply the router input by uniform noise in [1 - eps, 1 + eps] when training"
    )
    moe_router_enable_expert_bias: bool = flag_field(
        False, "auxiliary-loss-free load balancing: a per-expert bias added for expert selection"
    )
    moe_router_bias_update_rate: float = flag_field(1e-3, "step of the expert-bias update after each iteration")
    moe_token_dispatcher_type: str = flag_field(
        "allgather",
        "how tokens reach their experts over the expert-parallel group",
        choices=["allgather", "alltoall", "flex"],
    )
    moe_grouped_gemm: bool = flag_field(
        False, "compute all local experts with one grouped GEMM (torch._grouped_mm) when available"
    )
    moe_permute_fusion: bool = flag_field(
        False, "fused token permutation kernel (gigatron's permutation is one index_select)"
    )
    moe_router_force_load_balancing: bool = flag_field(
        False, "route tokens as if the router were perfectly balanced (benchmarking)"
    )
    moe_flex_dispatcher_backend: Optional[str] = flag_field(
        None,
        "backend of the flex token dispatcher",
        choices=["deepep", "hybridep", "ncclep"],
        default_help="deepep",
    )
    moe_expert_capacity_factor: Optional[float] = flag_field(
        None, "expert capacity = factor x tokens x topk / experts; tokens beyond it are dropped"
    )
    moe_token_drop_policy: str = flag_field(
        "probs",
        "which tokens an expert over capacity keeps: the highest probabilities or the first",
        choices=["probs", "position"],
    )
    moe_pad_expert_input_to_capacity: bool = flag_field(
        False, "pad every expert's input to its capacity (static shapes)"
    )
    moe_per_layer_logging: bool = flag_field(False, "also log the MoE losses and load statistics of each layer")

    def problems(self) -> list[str]:
        """The router, load balancing, capacity and shared-expert rules (Megatron's)."""
        if self.num_experts is None:
            changed = [
                "--" + f.name.replace("_", "-") for f in dataclasses.fields(self) if getattr(self, f.name) != f.default
            ]
            return [f"{', '.join(changed)} need --num-experts (an MoE model)"] if changed else []
        if self.num_experts < 1:
            return [f"--num-experts {self.num_experts} must be positive (leave it out for a dense model)"]
        return self.router_problems() + self.balancing_problems()

    def router_problems(self) -> list[str]:
        """Top-k, group-limited routing and the expert bias."""
        experts, topk = self.num_experts, self.moe_router_topk
        found = []
        if not 1 <= topk <= experts:
            found.append(f"--moe-router-topk {topk} must lie in [1, {experts}]")
        softmax_after_topk = self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax
        if topk == 1 and softmax_after_topk and self.moe_router_load_balancing_type != "sinkhorn":
            found.append(
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a "
                "softmax over one logit is constant: the router would get no gradient)"
            )
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if group_topk is not None or groups is not None:
            if groups is None or group_topk is None:
                found.append("group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk")
            elif experts % groups or not 1 <= group_topk <= groups:
                found.append(
                    f"--moe-router-num-groups {groups} must divide --num-experts {experts} and "
                    f"--moe-router-group-topk {group_topk} must lie in [1, {groups}]"
                )
            elif topk < group_topk or topk > group_topk * (experts // groups):
                found.append(
                    f"--moe-router-topk {topk}: must lie between --moe-router-group-topk "
                    f"{group_topk} and the experts in the selected groups "
                    f"({group_topk * (experts // groups)})"
                )
        if self.moe_router_enable_expert_bias and self.moe_router_score_function == "softmax":
            found.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or sqrtsoftplus")
        return found

    def balancing_problems(self) -> list[str]:
        """Auxiliary loss, capacity, jitter and the shared expert's gate."""
        balancing, coeff = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        found = []
        if coeff < 0:
            found.append(f"--moe-aux-loss-coeff {coeff} must not be negative")
        elif coeff > 0 and balancing not in ("aux_loss", "seq_aux_loss"):
            found.append(
                f"--moe-aux-loss-coeff {coeff} has no effect with "
                f"--moe-router-load-balancing-type {balancing}; use aux_loss or seq_aux_loss, "
                "or drop the coefficient"
            )
        capacity = self.moe_expert_capacity_factor
        if capacity is not None:
            if capacity <= 0:
                found.append(
                    f"--moe-expert-capacity-factor {capacity} must be positive (leave it out for dropless routing)"
                )
            if balancing == "sinkhorn":
                found.append(
                    "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss or none "
                    "load balancing, not sinkhorn"
                )
        elif self.moe_pad_expert_input_to_capacity:
            found.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        jitter = self.moe_input_jitter_eps
        if jitter is not None and not 0.0 < jitter < 1.0:
            found.append(f"--moe-input-jitter-eps {jitter} must lie in (0, 1)")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            found.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        return found


def moe_layer_pattern(freq: str | int, num_layers: int) -> list[bool]:
    """Which of the `num_layers` layers are MoE layers, from `--moe-layer-freq`.

    An integer N makes layer i (0-based) an MoE layer when i % N == 0; a list pattern gives one
    0/1 entry per layer and may be written with `+` and `*` (e.g. `([1]*3+[0])*2`).
    """

    text = str(freq).strip()
    if "[" not in text:
        try:
            step = int(text)
        except ValueError:
            step = 0
        if step < 1:
            raise GigatronError(
                f"--moe-layer-freq {text}: not a positive integer or a list pattern; give e.g. "
                "2 (every other layer) or '[1,0,1,1]'"
            )
        return [i % step == 0 for i in range(num_layers)]
    pattern = evaluate_layer_pattern(text)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise GigatronError(
            f"--moe-layer-freq {text}: gives {len(pattern)} entries {pattern}; it needs one 0 or 1 "
            f"per layer ({num_layers} layers)"
        )
    return [bool(v) for v in pattern]


def evaluate_layer_pattern(text: str) -> list[int]:
    """A list expression of integer literals joined by `+` and `*` (never Python's eval)."""

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(item) for item in node.elts]
            if any(isinstance(item, list) for item in items):
                raise ValueError("nested list")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                return left * right
        raise ValueError("unsupported expression")

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        result = None
    if not isinstance(result, list):
        raise GigatronError(
            f"--moe-layer-freq {text}: not a list pattern of 0/1 entries; write e.g. '[1,0,1,0]' or '([1]*3+[0])*2'"
        )
    return result
