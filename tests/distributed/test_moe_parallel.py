"""A GPT with MoE layers trained for 10 iterations on expert-parallel layouts gives the
single-process run's losses, MoE reports, gradient norms, first-iteration gradients and final
weights: ep = 2 and 4 with each dispatcher, ep2 x tp2 (with and without sequence parallelism,
and with whole experts per rank, etp = 1), ep2 x pp2, and ep2 with the distributed optimizer
(and gradient-reduce overlap). Each layout sees the same global batches, split over its
data-parallel ranks and micro-batches."""

from __future__ import annotations

import pytest
import torch

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.families import get_family
from gigatron.models.params import count_parameters as count_model_parameters
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.random import seed_everything
from gigatron.parallel.schedules import ScheduleConfig, forward_backward
from gigatron.parallel.tensor_parallel import slice_for_rank
from gigatron.training.loop import mean_losses, reduce_loss_reports
from gigatron.training.metrics import count_active_parameters, count_parameters

pytestmark = pytest.mark.distributed

SEQ, MICRO, GLOBAL, VOCAB, ITERS = 16, 2, 8, 64, 10


def _config(tp=1, pp=1, ep=1, etp=None, sp=False, distopt=False, **moe) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, SEQ
    m.ffn_hidden_size, m.swiglu, m.add_bias_linear = 32, True, False
    m.normalization, m.position_embedding_type = "RMSNorm", "rope"
    m.attention_dropout = m.hidden_dropout = 0.0
    m.padded_vocab_size = VOCAB
    e = cfg.moe
    e.num_experts, e.moe_router_topk, e.moe_layer_freq = 8, 2, "[1,0]"
    e.moe_aux_loss_coeff, e.moe_z_loss_coeff = 1e-2, 1e-3
    e.moe_grouped_gemm, e.moe_shared_expert_intermediate_size = True, 16
    for key, value in moe.items():
        setattr(e, key, value)
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.expert_model_parallel_size, p.expert_tensor_parallel_size = ep, etp
    p.sequence_parallel = sp
    p.use_distributed_optimizer = p.overlap_grad_reduce = distopt
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.seed = MICRO, GLOBAL, 7
    cfg.optimizer.lr, cfg.optimizer.clip_grad = 3e-3, 1.0
    finalize_config(cfg)
    return cfg


def _samples(iteration: int, dp_rank: int, dp_size: int):
    """This data-parallel rank's contiguous slice of the iteration's global batch."""
    generator = torch.Generator().manual_seed(1000 + iteration)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=generator)
    per_rank = GLOBAL // dp_size
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    for start in range(0, per_rank, MICRO):
        chunk = mine[start : start + MICRO]
        yield {
            "tokens": chunk[:, :-1],
            "labels": chunk[:, 1:],
            "loss_mask": torch.ones(MICRO, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
        }


def train(cfg: GigatronConfig, pctx: ParallelContext):
    """ITERS iterations; (losses per iteration, grad norms, first gradients, final params)."""
    family = get_family("gpt")
    seed_everything(cfg.training.seed, pctx)
    chunks = family.build_model(cfg, pctx, vocab_size=VOCAB)
    model = [DistributedDataParallel(c, pctx, cfg.parallel) for c in chunks]
    optimizer = build_optimizer(cfg, model, pctx)
    names = family.loss_names(cfg)
    step = family.make_forward_step(cfg, pctx)
    schedule = ScheduleConfig(
        seq_length=SEQ,
        micro_batch_size=MICRO,
        hidden_size=cfg.model.hidden_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
        grad_scale_func=optimizer.scale_loss,
    )
    microbatches = GLOBAL // (MICRO * pctx.dp_size)
    losses, norms, first_grads = [], [], None
    for iteration in range(ITERS):
        optimizer.zero_grad()
        data = _samples(iteration, pctx.dp_rank, pctx.dp_size)
        reports = forward_backward(step, data, model, microbatches, pctx, schedule)
        finalize_model_grads(model, pctx)
        reports.append(family.iteration_reports(cfg, pctx, model))
        losses.append(mean_losses(reduce_loss_reports(reports, pctx, names)))
        if first_grads is None and not cfg.parallel.use_distributed_optimizer:
            first_grads = {
                name: p.main_grad.clone()
                for chunk in model
                for name, p in chunk.module.named_parameters()
            }
        success, norm, _ = optimizer.step()
        assert success
        norms.append(norm)
    params = {n: p.detach().clone() for c in model for n, p in c.module.named_parameters()}
    buffers = {n: b.clone() for c in model for n, b in c.module.named_buffers() if "bias" in n}
    # Parameter counts, with the experts of every rank counted once.
    params["counts"] = torch.tensor(
        [count_parameters(model, pctx), count_active_parameters(model, pctx, 2, 8)]
    )
    return losses, norms, first_grads, {**params, **buffers}, model


def _local_slice(full: torch.Tensor, param, pctx: ParallelContext) -> torch.Tensor:
    """This rank's part of a full (single-process) tensor."""
    if param is None:
        return full
    if getattr(param, "expert_parallel", False):
        full = full.chunk(pctx.ep_size)[pctx.ep_rank]
        return slice_for_rank(
            full, param.partition_dim, param.partition_stride, pctx.etp_rank, pctx.etp_size
        )
    if getattr(param, "tensor_model_parallel", False):
        return slice_for_rank(
            full, param.partition_dim, param.partition_stride, pctx.tp_rank, pctx.tp_size
        )
    return full


def _reference_name(name: str, reference: dict) -> str:
    # With pp > 1 the last stage holds a copy of the tied embedding as the output weight.
    if name not in reference and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def _compare(reference, cfg: GigatronConfig, pctx: ParallelContext, case: str) -> None:
    ref_losses, ref_norms, ref_grads, ref_params = reference
    losses, norms, grads, params, model = train(cfg, pctx)
    for iteration, (got, expected) in enumerate(zip(losses, ref_losses)):
        assert got.keys() == expected.keys(), case
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=2e-5, abs=1e-6), (case, iteration, name)
    assert norms == pytest.approx(ref_norms, rel=2e-5), case
    named = {n: p for c in model for n, p in c.module.named_parameters()}
    if grads is not None:
        for name, grad in grads.items():
            expected = _local_slice(ref_grads[_reference_name(name, ref_grads)], named[name], pctx)
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=f"{case} {name}")
    for name, value in params.items():
        expected = _local_slice(
            ref_params[_reference_name(name, ref_params)], named.get(name), pctx
        )
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=f"{case} {name}")


LAYOUTS = [
    ("ep2 alltoall", dict(ep=2), dict(moe_token_dispatcher_type="alltoall")),
    ("ep2 allgather", dict(ep=2), dict(moe_token_dispatcher_type="allgather")),
    ("ep4 alltoall", dict(ep=4), dict(moe_token_dispatcher_type="alltoall")),
    ("ep4 allgather", dict(ep=4), dict(moe_token_dispatcher_type="allgather")),
    ("ep2 tp2 sp", dict(ep=2, tp=2, sp=True), dict(moe_token_dispatcher_type="alltoall")),
    ("ep2 tp2", dict(ep=2, tp=2), dict(moe_token_dispatcher_type="allgather")),
    (
        "ep2 tp2 etp1 sp",
        dict(ep=2, tp=2, etp=1, sp=True),
        dict(moe_token_dispatcher_type="alltoall"),
    ),
    ("ep2 pp2", dict(ep=2, pp=2), dict(moe_token_dispatcher_type="alltoall")),
    ("ep2 dp4 distopt", dict(ep=2, distopt=True), dict(moe_token_dispatcher_type="alltoall")),
]
# Routing options some layouts use too (their reference is computed with them).
BIASED = dict(
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_load_balancing_type="seq_aux_loss",
)
OPTIONS = {"ep2 pp2": BIASED, "ep4 allgather": BIASED}


def _reference(options: dict):
    losses, norms, grads, params, _ = train(_config(**options), ParallelContext.single())
    return losses, norms, grads, params


def _layouts(rank: int, world_size: int, references: dict) -> None:
    for case, sizes, moe in LAYOUTS:
        extra = OPTIONS.get(case, {})
        cfg = _config(**sizes, **moe, **extra)
        pctx = ParallelContext.from_sizes(
            tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), ep=sizes["ep"], etp=sizes.get("etp")
        )
        _compare(references[bool(extra)], cfg, pctx, case)


def test_expert_parallel_training_matches_single_process() -> None:
    references = {False: _reference({}), True: _reference(BIASED)}
    # The routing changes with the expert bias: the two references differ.
    assert references[False][0][-1]["lm_loss"] != references[True][0][-1]["lm_loss"]
    analytic = count_model_parameters(_config(), VOCAB)
    assert references[False][3]["counts"].tolist() == [analytic.total, analytic.active]
    run_distributed(_layouts, 4, references)
