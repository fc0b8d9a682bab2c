"""The top-k router: gating logits, expert selection, capacity, auxiliary losses, expert bias.

A router sees this rank's tokens [T, h]. The T tokens are this rank's share of the micro-batch:
the MoE layer splits every sequence over the tensor-parallel ranks (and context parallelism
splits it further), the "token group" `tp_cp`. Quantities over the whole micro-batch (tokens per
expert in the load-balancing loss) are summed over that group, and each rank's auxiliary losses
are its share of the whole (the shares add up), so the router weight, whose gradient is summed
over tensor-parallel ranks, gets exactly the single-device gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gigatron.models.moe import routing
from gigatron.models.moe.aux_loss import AuxLossScale, attach_aux_loss, first_pass_weight
from gigatron.models.moe.reports import RoutingStats
from gigatron.models.moe.spec import MoESpec
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline_stage import AuxLossModule
from gigatron.parallel.tensor_parallel import set_tensor_parallel_attributes

TOKEN_GROUP = "tp_cp"


class TopKRouter(AuxLossModule):
    """Routes each token to `topk` experts; see the module docstring and models/moe/routing.py."""

    def __init__(
        self,
        moe: MoESpec,
        hidden_size: int,
        pctx: ParallelContext,
        layer_number: int,
        init_std: float,
        params_dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        """`bias`: a learned bias on the gating logits (Megatron's router with
        `add_bias_linear`; gpt-oss)."""
        super().__init__()
        self.moe = moe
        self.pctx = pctx
        self.layer_number = layer_number
        self.weight = nn.Parameter(
            torch.empty(moe.num_experts, hidden_size, dtype=params_dtype, device=pctx.device)
        )
        set_tensor_parallel_attributes(self.weight, False, init="normal", init_std=init_std)
        # Each tensor-parallel rank routes its own slice of the sequence: partial gradients,
        # summed over tp by finalize_model_grads.
        self.weight.sequence_parallel = pctx.tp_size > 1
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(moe.num_experts, dtype=params_dtype, device=pctx.device)
            )
            set_tensor_parallel_attributes(self.bias, False, init="normal", init_std=init_std)
            self.bias.sequence_parallel = pctx.tp_size > 1
        self.token_group_size = pctx.size(TOKEN_GROUP)
        self.aux_loss_scale = AuxLossScale()
        self.stats = RoutingStats(moe.num_experts, self.token_group_size, pctx.device)
        if moe.enable_expert_bias:
            zeros = torch.zeros(moe.num_experts, dtype=torch.float32, device=pctx.device)
            self.register_buffer("expert_bias", zeros.clone())
            self.register_buffer("local_tokens_per_expert", zeros.clone(), persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None

    def set_aux_loss_scale(self, value: torch.Tensor | float) -> None:
        """The gradient of an auxiliary loss (called by the schedule; see aux_loss.py)."""
        self.aux_loss_scale.set(value)

    def forward(
        self, tokens: torch.Tensor, num_sequences: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T, h] (sequence-major: T = s x `num_sequences`) -> (probs [T, E],
        routing_map [T, E])."""
        moe = self.moe
        # Auxiliary losses belong to training passes. A checkpointed forward recomputed in
        # backward must rebuild the same graph, but its statistics are not counted again: they
        # are multiplied by `counted`, 0 in a recomputation (no Python branch: one compiled graph).
        training = self.training and torch.is_grad_enabled()
        if moe.input_jitter_eps is not None and self.training:
            eps = moe.input_jitter_eps
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - eps, 1.0 + eps)
        dtype = moe.router_dtype or tokens.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = F.linear(tokens.to(dtype), self.weight.to(dtype), bias)
        counted = first_pass_weight(logits) if training else None
        if moe.z_loss_coeff is not None and training:
            logits = self._apply_z_loss(logits, counted)

        if moe.load_balancing_type == "sinkhorn":
            probs, routing_map = routing.sinkhorn_routing(logits, moe.topk, self.training)
        else:
            probs, routing_map = routing.topk_routing(
                logits,
                moe.topk,
                moe.score_function,
                moe.pre_softmax,
                moe.num_groups,
                moe.group_topk,
                moe.topk_scaling_factor,
                self.expert_bias,
            )
        if moe.capacity_factor is not None:
            capacity = routing.expert_capacity(
                tokens.shape[0], moe.num_experts, moe.topk, moe.capacity_factor
            )
            probs, routing_map = routing.apply_capacity(
                probs, routing_map, capacity, moe.drop_policy, moe.pad_to_capacity
            )
        if moe.aux_loss_name is not None and training:
            probs = self._apply_load_balancing_loss(logits, probs, num_sequences, counted)
        if counted is not None:
            self.stats.add_routing(routing_map, tokens.shape[0] * moe.topk, counted)
            if self.local_tokens_per_expert is not None:
                self.local_tokens_per_expert += routing_map.sum(dim=0).float() * counted.float()
        return probs, routing_map

    def routed_copies(self, num_tokens: int) -> int | None:
        """The number of (token, expert) pairs the routing map of `num_tokens` tokens holds when
        the routing fixes it (top-k per token; every expert padded to its capacity), else None
        (which pairs a capacity drops depends on the data)."""
        moe = self.moe
        if moe.capacity_factor is None:
            return num_tokens * moe.topk
        capacity = routing.expert_capacity(
            num_tokens, moe.num_experts, moe.topk, moe.capacity_factor
        )
        if moe.pad_to_capacity:
            return moe.num_experts * min(capacity, num_tokens)
        return num_tokens * moe.topk if capacity >= num_tokens else None

    # ---- auxiliary losses ------------------------------------------------------------------
    def _per_token_factor(self, num_tokens: int) -> int:
        # Under --calculate-per-token-loss gradients are divided by the global token count
        # later: weigh by this micro-batch's tokens (all of the token group's) to compensate.
        return num_tokens * self.token_group_size if self.moe.per_token_loss else 1

    def _apply_z_loss(self, logits: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        # The mean over the whole micro-batch is the average of the group's equal-size shares.
        share = routing.z_loss(logits) / self.token_group_size
        self.stats.add_loss("z_loss", share, counted)
        weight = self.moe.z_loss_coeff * self._per_token_factor(logits.shape[0])
        return attach_aux_loss(logits, share * weight, self.aux_loss_scale)

    def _token_group_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.token_group_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, group=self.pctx.group(TOKEN_GROUP))
        return tensor

    def _apply_load_balancing_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, num_sequences: int, counted: torch.Tensor
    ) -> torch.Tensor:
        moe = self.moe
        routing_map, scores = routing.scores_for_aux_loss(logits, moe.topk, moe.score_function)
        num_tokens = logits.shape[0]
        if moe.load_balancing_type == "seq_aux_loss":
            # One loss per sequence: fold the sequences into the expert dimension.
            seq = num_tokens // num_sequences
            scores = scores.reshape(seq, num_sequences * moe.num_experts)
            routing_map = routing_map.reshape(seq, num_sequences * moe.num_experts)
        counts = self._token_group_sum(routing_map.sum(dim=0).to(scores.dtype))
        total = scores.shape[0] * self.token_group_size
        share = routing.load_balancing_loss(scores, counts, total, moe.topk, moe.num_experts)
        if moe.load_balancing_type == "seq_aux_loss":
            share = share / num_sequences
        self.stats.add_loss(moe.aux_loss_name, share, counted)
        weight = moe.aux_loss_coeff * self._per_token_factor(num_tokens)
        return attach_aux_loss(probs, share * weight, self.aux_loss_scale)


@torch.no_grad()
def update_expert_bias(model_chunks: Iterable[nn.Module], pctx: ParallelContext) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after each training iteration move every
    expert's bias by `rate` towards balance: up for experts that got fewer tokens than the mean
    over the iteration's global batch, down for those that got more. Collective over the ranks
    of a pipeline stage (tp x cp x dp)."""
    routers = [
        module
        for chunk in model_chunks
        for module in chunk.modules()
        if isinstance(module, TopKRouter) and module.expert_bias is not None and module.training
    ]
    if not routers:
        return
    counts = torch.stack([router.local_tokens_per_expert for router in routers])
    for group in ("tp_cp", "dp"):
        if pctx.size(group) > 1:
            dist.all_reduce(counts, group=pctx.group(group))
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for router, step in zip(routers, torch.sign(offset)):
        router.expert_bias += step * router.moe.bias_update_rate
        router.local_tokens_per_expert.zero_()
