"""ZB-H1 (`--pipeline-schedule zb-h1`) and `--no-overlap-p2p-communication` at pp 2 train the GPT
exactly like one process (test_pipeline.py's harness and reference: same losses for 10
iterations, same final weights), with the schedule's own order and one gradient reduction per
iteration, on the last micro-batch's weight-gradient step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_pipeline import (
    ADAM_EPS,
    BASE_FLAGS,
    ITERATIONS,
    LR,
    MICROBATCHES,
    SyncRecorder,
    Trace,
    forward_step,
    iteration_loss,
    microbatches,
    reference_run,
    schedule_config,
)

from gigatron.config import parse_config
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import (
    forward_backward,
    pipeline_schedule_order,
    zb_h1_schedule_order,
)

pytestmark = pytest.mark.distributed

# (schedule, overlap p2p)
VARIANTS = [("zb-h1", True), ("zb-h1", False), ("1f1b", False)]


def run_variant(schedule: str, overlap: bool, reference) -> None:
    ref_losses, ref_weights = reference
    cfg = parse_config([*BASE_FLAGS, "--pipeline-model-parallel-size", "2"], world_size=2)
    pctx = ParallelContext.from_sizes(pp=2)
    chunks = [SyncRecorder(chunk) for chunk in build_model(cfg, pctx)]
    optimizer = torch.optim.Adam(chunks[0].parameters(), lr=LR, eps=ADAM_EPS)
    config = dataclasses.replace(
        schedule_config(cfg), pipeline_schedule=schedule, overlap_p2p_comm=overlap
    )
    expected_order = (
        zb_h1_schedule_order(2, pctx.pp_rank, MICROBATCHES)
        if schedule == "zb-h1"
        else pipeline_schedule_order(2, pctx.pp_rank, MICROBATCHES)
    )
    losses = []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        trace = Trace()
        reports = forward_backward(
            forward_step, iter(microbatches(iteration)), chunks, MICROBATCHES, pctx, config,
            observer=trace,
        )  # fmt: skip
        assert trace.steps == expected_order
        finalize_model_grads(chunks, pctx)
        optimizer.step()
        if pctx.is_pipeline_last_stage():
            losses.append(iteration_loss(reports))
    # the first parameter's gradient is accumulated once per micro-batch (the W step), the
    # reduction enabled only for the last one
    assert chunks[0].sync_events == ([False] * (MICROBATCHES - 1) + [True]) * ITERATIONS
    if pctx.is_pipeline_last_stage():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    for name, param in chunks[0].module.named_parameters():
        if getattr(param, "shared_embedding", False):
            name = "embedding.word_embeddings.weight"
        torch.testing.assert_close(param.detach(), ref_weights[name], rtol=1e-4, atol=1e-5)


def _run(rank: int, world_size: int, reference) -> None:
    for schedule, overlap in VARIANTS:
        run_variant(schedule, overlap, reference)


def test_zb_h1_and_no_overlap_equal_one_process():
    run_distributed(_run, 2, reference_run())
