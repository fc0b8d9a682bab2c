"""DualPipeV (`--pipeline-schedule dualpipev`, two chunks per rank in a V) trains the GPT exactly
like one process at pp 4 and at pp 2 x tp 2 without overlapped receives
(--no-overlap-p2p-communication; one launch of 4 ranks): the same losses over 4
iterations, the same final weights, the schedule's own order, one gradient reduction per chunk
and iteration; its forward-only pass (evaluation) gives the reference's first loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_pipeline import (
    ADAM_EPS,
    BASE_FLAGS,
    LR,
    MICRO_BATCH,
    SyncRecorder,
    Trace,
    expected_shard,
    forward_step,
    iteration_loss,
    microbatches,
    schedule_config,
)

from gigatron.config import parse_config
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import dualpipev_schedule_order, forward_backward

pytestmark = pytest.mark.distributed

ITERATIONS, MICROBATCHES = 4, 8  # DualPipeV needs at least 2 x pp micro-batches
FLAGS = [*BASE_FLAGS, "--untie-embeddings-and-output-weights", "--global-batch-size",
         str(MICRO_BATCH * MICROBATCHES)]  # fmt: skip


def batches(iteration: int) -> list[dict[str, torch.Tensor]]:
    """Eight micro-batches: test_pipeline's four of two iterations."""
    return microbatches(2 * iteration) + microbatches(2 * iteration + 1)


def reference_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = parse_config(FLAGS, world_size=1)
    pctx = ParallelContext.single()
    (model,) = build_model(cfg, pctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses = []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step, iter(batches(iteration)), [model], MICROBATCHES, pctx,
            schedule_config(cfg),
        )  # fmt: skip
        losses.append(iteration_loss(reports))
        optimizer.step()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def run_layout(tp: int, pp: int, overlap_p2p: bool, reference) -> None:
    ref_losses, ref_weights = reference
    flags = [*FLAGS, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
             str(pp), "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule",
             "dualpipev"]  # fmt: skip
    cfg = parse_config(flags, world_size=tp * pp)
    pctx = ParallelContext.from_sizes(tp=tp, pp=pp)
    chunks = [SyncRecorder(chunk) for chunk in build_model(cfg, pctx)]
    where = f"tp={tp} pp={pp} overlap={overlap_p2p} rank {pctx.rank}"
    # The V: rank r holds stages r and 2 pp - 1 - r; rank 0 embeds and has the output layer.
    per_stage = 8 // (2 * pp)
    stages = [pctx.pp_rank, 2 * pp - 1 - pctx.pp_rank]
    for chunk, stage in zip(chunks, stages):
        expected_layers = [str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)]
        assert list(chunk.module.decoder.layers) == expected_layers, where
    assert [c.module.post_process for c in chunks] == [False, pctx.pp_rank == 0], where
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.Adam(params, lr=LR, eps=ADAM_EPS)
    config = dataclasses.replace(
        schedule_config(cfg), pipeline_schedule="dualpipev", overlap_p2p_comm=overlap_p2p
    )
    with torch.no_grad():
        reports = forward_backward(
            forward_step, iter(batches(0)), chunks, MICROBATCHES, pctx, config, forward_only=True
        )
    if pctx.pp_rank == 0:
        assert iteration_loss(reports) == pytest.approx(ref_losses[0], rel=1e-5), where
    losses = []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        trace = Trace()
        reports = forward_backward(
            forward_step, iter(batches(iteration)), chunks, MICROBATCHES, pctx, config,
            observer=trace,
        )  # fmt: skip
        assert trace.steps == dualpipev_schedule_order(pp, pctx.pp_rank, MICROBATCHES), where
        finalize_model_grads(chunks, pctx)
        optimizer.step()
        if pctx.pp_rank == 0:
            losses.append(iteration_loss(reports))
        else:
            assert reports == [], where
    for chunk in chunks:
        assert chunk.sync_events == ([False] * (MICROBATCHES - 1) + [True]) * ITERATIONS, where
    if pctx.pp_rank == 0:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            expected = expected_shard(ref_weights[name], param, pctx)
            torch.testing.assert_close(param.detach(), expected, rtol=1e-4, atol=1e-5,
                                       msg=lambda text, name=name: f"{where} {name}: {text}")  # fmt: skip


def _run(rank: int, world_size: int, reference) -> None:
    run_layout(1, 4, True, reference)
    run_layout(2, 2, False, reference)  # and each receive posted by the step that needs it


def test_dualpipev_equals_one_process_at_pp4_and_pp2_tp2():
    run_distributed(_run, 4, reference_run())
