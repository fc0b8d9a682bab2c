"""The routing arithmetic, as pure functions on [tokens, experts] tensors (Megatron's formulas).

Naming: `logits` come out of the router's linear layer; `scores` are the score function of them
(softmax, sigmoid, sqrt(softplus)); `probs` [T, E] are the weights the experts' outputs are
combined with (zero where a token is not routed); `routing_map` [T, E] is True where a token goes
to an expert.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def score(logits: torch.Tensor, function: str) -> torch.Tensor:
    """Scores in float32 (float64 logits stay float64)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    if function == "softmax":
        return torch.softmax(x, dim=-1)
    if function == "sigmoid":
        return torch.sigmoid(x)
    if function == "sqrtsoftplus":
        return F.softplus(x).sqrt()
    raise ValueError(f"unknown score function {function!r}")


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the `group_topk` best of `num_groups` equal expert groups; a group's
    score is the sum of its best topk // group_topk scores (DeepSeek-V2/V3 device/node limits)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=-1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] in the logits' dtype, routing_map [T, E] bool).

    softmax: top-k of the logits then a softmax over those k (Mixtral), or with `pre_softmax` a
    softmax over all experts then the top-k values (no renormalisation). sigmoid/sqrtsoftplus:
    top-k of the scores (plus `expert_bias`, for selection only), normalised to sum 1 when k > 1.
    `scaling_factor` multiplies the final probabilities.
    """
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = _topk(score(logits, "softmax"), topk, num_groups, group_topk)
        else:
            top_logits, indices = _topk(logits, topk, num_groups, group_topk)
            probs = score(top_logits, "softmax")
    else:
        scores = score(logits, score_function)
        if expert_bias is not None:
            _, indices = _topk(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk)
            probs = scores.gather(1, indices)
        else:
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


@torch.library.custom_op("gigatron::sinkhorn", mutates_args=())
def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(cost): rows and columns alternately rescaled until the
    column factors move less than `tol` on average (S-BASE routing). An opaque operator: its loop
    stops on a value read from the data, which would break a compiled layer's graph."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.shape[0], device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.shape[1], device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    error, d1_old = 1e9, d1
    while error > tol:
        d0 = (1.0 / d0.shape[0]) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1.0 / d1.shape[0]) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1)).item()
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


@sinkhorn.register_fake
def _(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    return torch.empty_like(cost)


def sinkhorn_routing(
    logits: torch.Tensor, topk: int, training: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training: experts chosen on the Sinkhorn-balanced logits; eval: on the scores. The weights
    are sigmoid (k = 1) or softmax (k > 1) of the logits, kept at the chosen experts."""
    if topk == 1:
        activated = torch.sigmoid(logits)
    else:
        activated = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
    with torch.no_grad():
        basis = sinkhorn(logits.float()) if training else activated
        indices = basis.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return activated * routing_map, routing_map


def scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map, scores) the load-balancing loss uses: scores over all experts (sigmoid and
    sqrtsoftplus normalised to sum 1) and their plain top-k."""
    scores = score(logits, score_function)
    if score_function != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
    return routing_map, scores


def load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int,
    topk: int,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Switch/GShard loss  E * sum_i f_i * P_i  (without its coefficient), where
    f_i = tokens_per_expert_i / (T k) and P_i = sum of expert i's scores / T over all T tokens.

    `scores` may be this rank's share of the tokens (with `tokens_per_expert` and `total_tokens`
    counted over all of them): the result is then this rank's share of the loss, and the shares
    of all ranks add up to it. `num_experts` defaults to the width of `scores` (the per-sequence
    loss passes E for scores laid out [tokens, sequences x E]: the sum of the sequences' losses).
    """
    num_experts = num_experts or scores.shape[-1]
    per_expert = scores.sum(dim=0)
    weight = num_experts / (topk * total_tokens * total_tokens)
    return torch.sum(per_expert * tokens_per_expert.to(per_expert.dtype)) * weight


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2 (without coefficient)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return torch.logsumexp(x, dim=-1).square().mean()


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens an expert accepts: ceil(T * k / E * capacity_factor)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity: int,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `capacity` tokens per expert: those with the highest probabilities
    ("probs") or the earliest in the sequence ("position"). With `pad_to_capacity` every expert
    gets exactly min(capacity, T) tokens: the kept ones plus tokens it was not routed (probability
    0). Returns the new (probs, routing_map)."""
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            ranking = probs
        elif drop_policy == "position":
            # Routed tokens first, then by position (earlier wins).
            order = torch.arange(num_tokens, 0, -1, device=probs.device, dtype=torch.float64)
            ranking = routing_map.double() * (num_tokens + 1) + order.unsqueeze(1)
        else:
            raise ValueError(f"unknown drop policy {drop_policy!r}")
        chosen = ranking.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    new_map = keep if pad_to_capacity else routing_map & keep
    return probs * new_map, new_map
