"""DualPipeV's order (parallel/schedules.py) and the V placement: every step once, no deadlock on
the zero-latency simulation of parallel/bubble.py, 2 pp + 1 chunk activations at most, and a
smaller bubble than 1F1B, interleaved 1F1B and ZB-H1 at the same p, m; the simulation itself
against hand-counted makespans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.models.params import count_parameters
from gigatron.parallel.bubble import StepCosts, simulate, stage_of
from gigatron.parallel.pipeline import PipelineCommunicator, chunk_layer_ranges
from gigatron.parallel.schedules import (
    dualpipev_schedule_order,
    pipeline_schedule_order,
    zb_h1_schedule_order,
)

HALF = StepCosts(0.5, 0.5, 0.5)  # a chunk of two per rank: half a stage's work


def peak_live(order: list[tuple[str, int, int]]) -> int:
    """The most chunk activations held at once: from a forward to the end of its backward."""
    split = {(chunk, mb) for kind, chunk, mb in order if kind == "W"}
    live = peak = 0
    for kind, chunk, mb in order:
        live += kind == "F"
        live -= kind == "W" or (kind == "B" and (chunk, mb) not in split)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_dualpipev_runs_every_step_once_with_a_small_bubble(pp, m):
    orders = [dualpipev_schedule_order(pp, rank, m) for rank in range(pp)]
    for order in orders:
        for kind in "FB":
            for chunk in (0, 1):
                assert sorted(mb for k, c, mb in order if (k, c) == (kind, chunk)) == list(range(m))
        weights = [(c, mb) for k, c, mb in order if k == "W"]
        assert len(weights) == len(set(weights)) == pp  # pp backwards split on every rank
        assert peak_live(order) == 2 * pp + 1
    dualpipev = simulate(orders, v_shape=True, costs=HALF)
    one_f_one_b = simulate([pipeline_schedule_order(pp, r, m) for r in range(pp)])
    zb_h1 = simulate([zb_h1_schedule_order(pp, r, m) for r in range(pp)])
    interleaved = simulate([pipeline_schedule_order(pp, r, m, 2) for r in range(pp)], costs=HALF)
    # the same model either way; stage 0 (a whole one, or half of one) has no input gradient
    assert sum(one_f_one_b.busy) == pytest.approx(pp * m * 3.0 - m * 1.0)
    assert sum(dualpipev.busy) == pytest.approx(pp * m * 3.0 - m * 0.5)
    assert dualpipev.makespan < interleaved.makespan < one_f_one_b.makespan
    assert dualpipev.makespan < zb_h1.makespan <= one_f_one_b.makespan


def test_simulation_against_hand_counts():
    # 1F1B, p = 2, m = 4, F = B = W = 1, stage 0 without an input gradient (backward 1, not 2):
    # rank 1 starts after rank 0's first forward (1), runs 4 F B pairs (4 x 3, until 13), then
    # rank 0 runs the last backward (14); rank 0 is busy 4 x (1 + 1), rank 1 12.
    report = simulate([pipeline_schedule_order(2, r, 4) for r in range(2)])
    assert report.makespan == pytest.approx(14.0)
    assert report.busy == pytest.approx([8.0, 12.0])
    assert report.idle_fractions() == pytest.approx([6 / 14, 2 / 14])
    assert report.bubble() == pytest.approx(8 / 20)
    assert stage_of(4, 1, 1, v_shape=True) == 6 and stage_of(4, 1, 1, v_shape=False) == 5
    with pytest.raises(RuntimeError, match="deadlocks"):
        # rank 0 waits for micro-batch 1's gradient before sending micro-batch 1 forward
        simulate([[("B", 0, 1), ("F", 0, 0), ("F", 0, 1), ("B", 0, 0)],
                  pipeline_schedule_order(2, 1, 2)])  # fmt: skip


def test_v_placement_and_refusals():
    assert chunk_layer_ranges(8, 2, 2, v_shape=True) == [
        [range(0, 2), range(6, 8)],
        [range(2, 4), range(4, 6)],
    ]
    with pytest.raises(GigatronError, match="divisible by 2 x the pipeline size"):
        chunk_layer_ranges(6, 2, 2, v_shape=True)
    with pytest.raises(GigatronError, match="at least 2 x the pipeline size = 8"):
        dualpipev_schedule_order(4, 0, 6)
    base = "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    base += "--max-position-embeddings 16 --micro-batch-size 1 --vocab-size 64 "
    base += "--global-batch-size 4 --make-vocab-size-divisible-by 1 "
    base += "--pipeline-model-parallel-size 2 --pipeline-schedule dualpipev"
    with pytest.raises(GigatronError, match="num-virtual-stages-per-pipeline-rank 2"):
        parse_config(base.split(), world_size=2)
    base += " --num-virtual-stages-per-pipeline-rank 2"
    with pytest.raises(GigatronError, match="3 micro-batches per iteration, it needs at least"):
        parse_config([*base.split(), "--global-batch-size", "3"], world_size=2)
    with pytest.raises(GigatronError, match="--untie-embeddings-and-output-weights"):
        parse_config(base.split(), world_size=2)
    cfg = parse_config([*base.split(), "--untie-embeddings-and-output-weights"], world_size=2)
    # rank 0: embeddings (64 x 32 words + 16 x 32 positions), layers 0-1 and 6-7, the final
    # norm (2 x 32) and the output layer (64 x 32); rank 1: layers 2-5
    counts = count_parameters(cfg, 64)
    assert counts.per_stage == [2560 + 4 * counts.per_layer + 64 + 2048, 4 * counts.per_layer]


def test_nccl_is_refused_because_the_v_streams_cross():
    """NCCL matches a link's messages by order: at p = 4 rank 0 sends micro-batch 6's activation
    before micro-batch 0's chunk-1 input gradient, and rank 1 needs them the other way round."""
    orders = [dualpipev_schedule_order(4, rank, 8) for rank in range(4)]
    down = (("F", 0), ("B", 1))  # the messages rank 0 sends to rank 1
    sent = [step for step in orders[0] if step[:2] in down]
    needed = [step for step in orders[1] if step[:2] in down]
    assert sorted(sent) == sorted(needed) and sent != needed
    nccl = SimpleNamespace(backend="nccl")
    with pytest.raises(GigatronError, match="matches them by order"):
        PipelineCommunicator(nccl, (2, 1, 8), torch.float32, 8, num_chunks=2, v_shape=True)
