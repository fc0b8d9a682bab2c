"""Router arithmetic against hand-computed values: top-k selection and scaling, score functions,
group-limited routing, the load-balancing and z-loss formulas and their gradients, capacity and
drop policies, the expert-bias update, the layer-frequency patterns and the logged reports."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gigatron.config.moe import moe_layer_pattern
from gigatron.errors import GigatronError
from gigatron.models.moe import routing
from gigatron.models.moe.reports import collect_moe_reports
from gigatron.models.moe.router import TopKRouter, update_expert_bias
from gigatron.models.moe.spec import MoESpec
from gigatron.parallel.context import ParallelContext


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_softmax_after_topk_renormalises_over_the_chosen_experts():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    probs, routing_map = routing.topk_routing(logits, topk=2)
    e = math.e
    assert routing_map.tolist() == [[False, True, True, False]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1 / (e + 1), e / (e + 1), 0.0]]))
    scaled, _ = routing.topk_routing(logits, topk=2, scaling_factor=2.5)
    torch.testing.assert_close(scaled, probs * 2.5)


def test_pre_softmax_keeps_the_full_softmax_values():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    probs, _ = routing.topk_routing(logits, topk=2, pre_softmax=True)
    z = math.exp(0) + math.exp(1) + math.exp(2) + math.exp(3)
    expected = torch.tensor([[0.0, math.exp(2) / z, math.exp(3) / z, 0.0]])
    torch.testing.assert_close(probs, expected)


def test_sigmoid_scores_normalised_and_expert_bias_only_selects():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    probs, routing_map = routing.topk_routing(logits, topk=2, score_function="sigmoid")
    a, b = _sigmoid(1.0), _sigmoid(2.0)
    torch.testing.assert_close(probs, torch.tensor([[0.0, a / (a + b), 0.0, b / (a + b)]]))
    # A bias of +1 on expert 2 makes it beat expert 1 (0.269 + 1 > 0.731), but its weight is
    # still its unbiased score.
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    probs, routing_map = routing.topk_routing(
        logits, topk=2, score_function="sigmoid", expert_bias=bias
    )
    c = _sigmoid(-1.0)
    assert routing_map.tolist() == [[False, False, True, True]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, c / (b + c), b / (b + c)]]))
    # k = 1: the sigmoid score itself, not renormalised.
    probs, _ = routing.topk_routing(logits, topk=1, score_function="sigmoid")
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 0.0, b]]))
    probs, _ = routing.topk_routing(logits, topk=1, score_function="sqrtsoftplus")
    torch.testing.assert_close(
        probs, torch.tensor([[0.0, 0.0, 0.0, math.sqrt(math.log1p(math.e**2))]])
    )


def test_group_limited_routing_picks_the_best_group_first():
    # Expert 0 has the best score, but group 1 (experts 2, 3) has the higher sum of its top-2
    # sigmoid scores: 2 x 0.953 > 0.993 + 0.007.
    logits = torch.tensor([[5.0, -5.0, 3.0, 3.0]])
    _, routing_map = routing.topk_routing(logits, topk=2, score_function="sigmoid")
    assert routing_map.tolist() == [[True, False, True, False]]
    probs, routing_map = routing.topk_routing(
        logits, topk=2, score_function="sigmoid", num_groups=2, group_topk=1
    )
    assert routing_map.tolist() == [[False, False, True, True]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 0.5, 0.5]]))


def test_load_balancing_loss_formula():
    scores = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    # E / (k T^2) * sum_e P_e f_e with P = column sums, f = token counts.
    balanced = routing.load_balancing_loss(scores, torch.tensor([1.0, 1.0]), total_tokens=2, topk=1)
    torch.testing.assert_close(balanced, torch.tensor((1.1 + 0.9) * 2 / 4))
    skewed = routing.load_balancing_loss(scores, torch.tensor([2.0, 0.0]), total_tokens=2, topk=1)
    torch.testing.assert_close(skewed, torch.tensor(1.1 * 2 * 2 / 4))


def test_z_loss_formula():
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    expected = (math.log(2.0) ** 2 + (1 + math.log(2.0)) ** 2) / 2
    torch.testing.assert_close(routing.z_loss(logits), torch.tensor(expected))


def test_capacity_and_drop_policies():
    # 4 tokens, 2 experts, k = 1, factor 1.0: capacity = ceil(4 * 1 / 2 * 1.0) = 2.
    assert routing.expert_capacity(4, 2, 1, 1.0) == 2
    assert routing.expert_capacity(5, 4, 2, 1.5) == 4  # ceil(5 * 2 / 4 * 1.5) = ceil(3.75)
    routing_map = torch.tensor([[True, False]] * 4)
    probs = torch.tensor([[0.9, 0.0], [0.6, 0.0], [0.8, 0.0], [0.7, 0.0]])
    kept, kept_map = routing.apply_capacity(probs, routing_map, 2, "probs")
    assert kept_map[:, 0].tolist() == [True, False, True, False]
    assert int(routing_map.sum() - kept_map.sum()) == 2  # two assignments dropped
    torch.testing.assert_close(kept[:, 0], torch.tensor([0.9, 0.0, 0.8, 0.0]))
    _, kept_map = routing.apply_capacity(probs, routing_map, 2, "position")
    assert kept_map[:, 0].tolist() == [True, True, False, False]
    # Padding: every expert gets exactly 2 rows; expert 1's are unrouted tokens with weight 0.
    padded, padded_map = routing.apply_capacity(probs, routing_map, 2, "position", True)
    assert padded_map.sum(dim=0).tolist() == [2, 2]
    assert padded_map[:, 1].tolist() == [True, True, False, False]
    assert padded[:, 1].abs().sum() == 0
    # A capacity above the token count drops nothing.
    _, kept_map = routing.apply_capacity(probs, routing_map, 5, "probs")
    assert torch.equal(kept_map, routing_map)


def test_sinkhorn_balances_rows_and_columns():
    cost = torch.tensor([[2.0, 0.0], [1.5, 0.1], [3.0, -1.0], [0.0, 0.0]])
    balanced = routing.sinkhorn(cost, tol=1e-8)
    torch.testing.assert_close(balanced.sum(0), torch.full((2,), 0.5), rtol=0, atol=1e-5)
    torch.testing.assert_close(balanced.sum(1), torch.full((4,), 0.25), rtol=0, atol=1e-5)
    # Plain top-1 would send every token to expert 0; Sinkhorn sends two to each.
    probs, routing_map = routing.sinkhorn_routing(cost, topk=1, training=True)
    assert routing_map.sum(0).tolist() == [2, 2]
    torch.testing.assert_close(probs, torch.sigmoid(cost) * routing_map)


def _router(**options) -> TopKRouter:
    spec = MoESpec(num_experts=4, ffn_hidden_size=8, topk=2, **options)
    router = TopKRouter(spec, 3, ParallelContext.single(), 1, 0.5, torch.float32)
    with torch.no_grad():
        router.weight.copy_(torch.arange(12, dtype=torch.float32).view(4, 3).sin())
    return router


def _tokens():
    return torch.tensor([[0.3, -1.0, 2.0], [1.0, 0.5, -0.5], [-0.2, 0.1, 0.4], [2.0, -1.0, 0.0]])


def test_router_aux_losses_get_exactly_their_gradient():
    """The injected gradient equals d(coeff x loss)/dW computed directly, times the scale."""
    coeff, z_coeff, scale = 0.1, 0.01, 0.25
    router = _router(aux_loss_coeff=coeff, z_loss_coeff=z_coeff)
    router.set_aux_loss_scale(scale)
    tokens = _tokens()
    probs, _ = router(tokens, num_sequences=2)
    (probs * 0.0).sum().backward()  # only the auxiliary losses reach the weight

    weight = router.weight.detach().clone().requires_grad_(True)
    logits = tokens @ weight.t()
    routing_map, scores = routing.scores_for_aux_loss(logits, 2, "softmax")
    aux = routing.load_balancing_loss(scores, routing_map.sum(0).float(), 4, 2)
    total = coeff * aux + z_coeff * routing.z_loss(logits)
    total.backward()
    torch.testing.assert_close(router.weight.grad, weight.grad * scale)


def test_seq_aux_loss_is_the_mean_over_sequences():
    router = _router(aux_loss_coeff=1.0, load_balancing_type="seq_aux_loss")
    tokens = _tokens()  # seq 2 x batch 2: rows (s0 b0), (s0 b1), (s1 b0), (s1 b1)
    router(tokens, num_sequences=2)
    logged = router.stats.pop()[2].item()  # seq_load_balancing_loss column
    per_sequence = []
    logits = tokens @ router.weight.detach().t()
    for b in range(2):
        rows = logits[b::2]
        routing_map, scores = routing.scores_for_aux_loss(rows, 2, "softmax")
        per_sequence.append(routing.load_balancing_loss(scores, routing_map.sum(0).float(), 2, 2))
    assert logged == pytest.approx(sum(per_sequence).item() / 2, rel=1e-6)


def test_expert_bias_update():
    router = _router(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    router.local_tokens_per_expert.copy_(torch.tensor([3.0, 1.0, 0.0, 4.0]))
    update_expert_bias([router], ParallelContext.single())
    # mean 2: experts above it go down, below it go up.
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, -0.01]))
    assert router.local_tokens_per_expert.sum() == 0
    # Counts accumulate over training forwards only.
    router(_tokens(), 2)
    assert router.local_tokens_per_expert.sum() == 8
    with torch.no_grad():
        router(_tokens(), 2)
    router.eval()
    router(_tokens(), 2)
    assert router.local_tokens_per_expert.sum() == 8
    assert "expert_bias" in router.state_dict()


def test_reports_average_over_micro_batches_and_layers():
    spec = dataclasses.replace(
        MoESpec(num_experts=4, ffn_hidden_size=8, topk=2, aux_loss_coeff=0.1),
        layer_pattern=(True, False, True),
        per_layer_logging=True,
        capacity_factor=1.0,
    )
    routers = []
    for layer_number in (1, 3):
        router = TopKRouter(spec, 3, ParallelContext.single(), layer_number, 0.5, torch.float32)
        routers.append(router)
    expected = {}
    for router in routers:
        values = []
        for step in range(2):
            router.stats.add_loss(
                "load_balancing_loss", torch.tensor(1.0 + step + router.layer_number)
            )
            routing_map = torch.zeros(4, 4, dtype=torch.bool)
            routing_map[:, 0] = True
            routing_map[0, 1] = True
            router.stats.add_routing(routing_map, routed_before_drop=8)
            values.append(1.0 + step + router.layer_number)
        expected[router.layer_number] = sum(values) / 2
    reports = collect_moe_reports(routers, ParallelContext.single(), spec)
    lb = reports["load_balancing_loss"]
    assert (lb[0] / lb[1]).item() == pytest.approx((expected[1] + expected[3]) / 2)
    layer2 = reports["load_balancing_loss_layer_2"]  # layer number 3 is index 2
    assert (layer2[0] / layer2[1]).item() == pytest.approx(expected[3])
    # Per layer over 2 micro-batches: counts [8, 2, 0, 0] -> mean 2.5, max 8, imbalance 3.2.
    for name, value in (
        ("tokens_per_expert_mean", 2.5),
        ("tokens_per_expert_max", 8.0),
        ("load_imbalance", 3.2),
        ("dropped_token_fraction", 6 / 16),
    ):
        assert (reports[name][0] / reports[name][1]).item() == pytest.approx(value), name
    assert "z_loss" not in reports
    assert collect_moe_reports(routers, ParallelContext.single(), spec) == {}  # cleared


def test_moe_layer_frequency_patterns():
    assert moe_layer_pattern(1, 3) == [True, True, True]
    assert moe_layer_pattern("2", 4) == [True, False, True, False]
    assert moe_layer_pattern("([1]*3+[0])*2", 8) == [True, True, True, False] * 2
    assert moe_layer_pattern("[0,1]", 2) == [False, True]
    with pytest.raises(GigatronError, match="one 0 or 1 per layer"):
        moe_layer_pattern("[1,0,1]", 2)
    with pytest.raises(GigatronError, match="not a list pattern"):
        moe_layer_pattern("[__import__('os')]", 1)
    with pytest.raises(GigatronError, match="positive integer"):
        moe_layer_pattern("0", 2)
