"""An MoE layer split over expert-parallel ranks (with expert tensor parallelism and sequence
parallelism, both dispatchers) gives the single-process layer's outputs, gradients, auxiliary
losses and load statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.models.moe import MoELayer, MoESpec, collect_moe_reports
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.tensor_parallel import initialize_parameters, merge_partitions

pytestmark = pytest.mark.distributed

SEQ, BATCH, HIDDEN, DP_MAX = 8, 2, 16, 4


def _specs(tp: int, sp: bool, **moe_options):
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 1, HIDDEN, 2, SEQ
    m.swiglu, m.add_bias_linear, m.ffn_hidden_size = True, False, 32
    e = cfg.moe
    e.num_experts, e.moe_router_topk, e.moe_grouped_gemm = 8, 2, True
    e.moe_aux_loss_coeff, e.moe_z_loss_coeff = 0.1, 0.01
    e.moe_shared_expert_intermediate_size, e.moe_shared_expert_gate = 16, True
    for key, value in moe_options.items():
        setattr(e, key, value)
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.sequence_parallel = sp
    return TransformerConfig.from_config(cfg), MoESpec.from_config(cfg)


def _data(dp_rank: int):
    generator = torch.Generator().manual_seed(11)
    inputs = torch.randn(DP_MAX, SEQ, BATCH, HIDDEN, generator=generator)
    weights = torch.randn(DP_MAX, SEQ, BATCH, HIDDEN, generator=generator)
    return inputs[dp_rank], weights[dp_rank]


def _reference(dp: int, tp: int, sp: bool, options: dict):
    spec, moe = _specs(1, False, **options)
    single = ParallelContext.single()
    layer = MoELayer(spec, moe, single, layer_number=1)
    initialize_parameters(layer, 5, 0, 1)
    outputs = []
    for d in range(dp):
        x, w = _data(d)
        y = layer(x)
        (y * w).sum().backward()
        outputs.append(y.detach())
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return outputs, grads, collect_moe_reports([layer], single, moe)


def _full_grad(param: torch.nn.Parameter, pctx: ParallelContext) -> torch.Tensor:
    grad = param.grad.clone()
    expert = getattr(param, "expert_parallel", False)
    if getattr(param, "sequence_parallel", False) and pctx.tp_size > 1:
        dist.all_reduce(grad, group=pctx.group("tp"))
    # Replicas see different micro-batches: sum over the replicas of this parameter.
    replicas = "expert_dp" if expert else "dp_cp"
    if pctx.size(replicas) > 1:
        dist.all_reduce(grad, group=pctx.group(replicas))
    split_group = "expert_tp" if expert else "tp"
    if getattr(param, "tensor_model_parallel", False) and pctx.size(split_group) > 1:
        parts = [torch.empty_like(grad) for _ in range(pctx.size(split_group))]
        dist.all_gather(parts, grad, group=pctx.group(split_group))
        grad = merge_partitions(parts, param.partition_dim, param.partition_stride)
    if expert and pctx.size("ep") > 1:
        parts = [torch.empty_like(grad) for _ in range(pctx.size("ep"))]
        dist.all_gather(parts, grad, group=pctx.group("ep"))
        grad = torch.cat(parts)
    return grad


def _check(pctx: ParallelContext, sp: bool, dispatcher: str, options: dict) -> None:
    tp = pctx.tp_size
    case = f"tp{tp} sp{sp} ep{pctx.ep_size} etp{pctx.etp_size} {dispatcher} {options}"
    options = {**options, "moe_token_dispatcher_type": dispatcher}
    ref_outputs, ref_grads, ref_reports = _reference(pctx.dp_size, tp, sp, options)
    spec, moe = _specs(tp, sp, **options)
    layer = MoELayer(spec, moe, pctx, layer_number=1)
    initialize_parameters(
        layer, 5, pctx.tp_rank, tp, pctx.ep_rank, pctx.ep_size, pctx.etp_rank, pctx.etp_size
    )
    x, w = _data(pctx.dp_rank)
    expected = ref_outputs[pctx.dp_rank]
    if sp:
        x, w, expected = (t.chunk(tp)[pctx.tp_rank] for t in (x, w, expected))
    y = layer(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6, msg=case)
    (y * w).sum().backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(
            _full_grad(param, pctx), ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"{case} {name}"
        )
    reports = collect_moe_reports([layer], pctx, moe)
    assert reports.keys() == ref_reports.keys(), case
    for name, value in reports.items():
        # Summed over data-parallel ranks (as the loop does), the ratio is the reference's.
        total = value.clone()
        dist.all_reduce(total, group=pctx.group("dp"))
        ratio, ref_ratio = total[0] / total[1], ref_reports[name][0] / ref_reports[name][1]
        torch.testing.assert_close(ratio, ref_ratio, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")


def _layouts(rank: int, world_size: int) -> None:
    for dispatcher in ("alltoall", "allgather"):
        dropping = {
            "moe_expert_capacity_factor": 1.0,
            "moe_pad_expert_input_to_capacity": True,
            "moe_router_load_balancing_type": "seq_aux_loss",
        }
        _check(ParallelContext.from_sizes(ep=2), False, dispatcher, {})
        _check(ParallelContext.from_sizes(ep=2), False, dispatcher, dropping)
        _check(ParallelContext.from_sizes(ep=4), False, dispatcher, {"moe_grouped_gemm": False})
        for sp in (False, True):
            _check(ParallelContext.from_sizes(tp=2, ep=2), sp, dispatcher, {})
        _check(ParallelContext.from_sizes(tp=2, ep=4, etp=1), True, dispatcher, {})


def test_expert_parallel_layer_matches_single_process() -> None:
    run_distributed(_layouts, 4)


def test_grouped_gemm_equals_loop() -> None:
    spec, moe = _specs(1, False)
    x, w = _data(0)
    results = []
    for grouped in (True, False):
        layer = MoELayer(
            spec, dataclasses.replace(moe, grouped_gemm=grouped), ParallelContext.single(), 1
        )
        initialize_parameters(layer, 5, 0, 1)
        y = layer(x)
        (y * w).sum().backward()
        assert layer.experts.grouped_gemm_used is grouped
        results.append((y, [p.grad for p in layer.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_recomputed_layer_records_and_attaches_once() -> None:
    """With activation recomputation the forward runs twice: the statistics are counted and the
    auxiliary losses back-propagated once, giving the plain layer's gradients."""
    from gigatron.parallel.random import recompute

    spec, moe = _specs(1, False)
    x, w = _data(0)
    grads, rows = [], []
    for checkpointed in (False, True):
        layer = MoELayer(spec, moe, ParallelContext.single(), 1)
        initialize_parameters(layer, 5, 0, 1)
        inputs = x.clone().requires_grad_(True)
        y = recompute(layer, inputs) if checkpointed else layer(inputs)
        (y * w).sum().backward()
        grads.append([p.grad for p in layer.parameters()] + [inputs.grad])
        rows.append(layer.router.stats.pop())
    torch.testing.assert_close(rows[0], rows[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
