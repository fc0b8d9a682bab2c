"""The schedule's contract with model chunks (`PipelineStage`) and its observer hook, in one
process: a chunk outside the contract gets a clear error, auxiliary-loss modules are the ones a
stage names, and the observer sees every forward and backward in order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gigatron.config import parse_config
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline_stage import (
    AuxLossModule,
    ChunkWrapper,
    PipelineStage,
    pipeline_stage,
)
from gigatron.parallel.schedules import ScheduleConfig, ScheduleObserver, forward_backward

MICROBATCHES = 3


class Recorder(ScheduleObserver):
    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int]] = []

    def on_step(self, kind: str, chunk: int, microbatch: int) -> None:
        self.steps.append((kind, chunk, microbatch))


class ScaleProbe(AuxLossModule):
    def __init__(self) -> None:
        super().__init__()
        self.scales: list[float] = []

    def set_aux_loss_scale(self, value) -> None:
        self.scales.append(float(value))


class Linear(PipelineStage):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))
        self.probe = ScaleProbe()

    def forward(self, x):
        return self.weight * x


class PlainModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.weight * x


class Wrapper(ChunkWrapper):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def forward_step(data_iterator, chunk):
    x = next(data_iterator)
    return chunk(x), lambda out: (out.sum(), torch.tensor(1.0), {"value": out.detach()})


def run(chunk: nn.Module, forward_only: bool = False, observer=None, loss_scale: float = 1.0):
    config = ScheduleConfig(
        seq_length=1, micro_batch_size=1, hidden_size=1, grad_scale_func=lambda x: x * loss_scale
    )
    data = iter([torch.tensor(float(i + 1)) for i in range(MICROBATCHES)])
    return forward_backward(
        forward_step, data, [chunk], MICROBATCHES, ParallelContext.single(), config,
        forward_only=forward_only, observer=observer,
    )  # fmt: skip


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_chunk_outside_the_contract_gets_a_clear_error(wrapped):
    chunk = Wrapper(PlainModule()) if wrapped else PlainModule()
    for forward_only in (False, True):
        with pytest.raises(TypeError, match="model chunk PlainModule is not a PipelineStage"):
            run(chunk, forward_only=forward_only)
    assert chunk.weight.grad is None  # refused before anything ran


def test_the_observer_sees_every_forward_and_backward_in_order():
    observer = Recorder()
    chunk = Linear()
    reports = run(chunk, observer=observer)
    assert observer.steps == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2),
                              ("B", 0, 2)]  # fmt: skip
    assert [r["value"].item() for r in reports] == [2.0, 4.0, 6.0]
    assert chunk.weight.grad.item() == pytest.approx((1 + 2 + 3) / MICROBATCHES)
    observer = Recorder()
    run(Wrapper(Linear()), forward_only=True, observer=observer)
    assert observer.steps == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2)]


def test_auxiliary_loss_modules_are_the_ones_the_stage_names():
    chunk = Linear()
    run(Wrapper(chunk), loss_scale=6.0)
    assert chunk.probe.scales == [6.0 / MICROBATCHES]  # the loss scale / micro-batches
    run(chunk, forward_only=True)
    assert chunk.probe.scales == [6.0 / MICROBATCHES]  # evaluation passes set nothing

    class Silent(Linear):
        def aux_loss_modules(self):
            return []

    silent = Silent()
    run(silent)
    assert silent.probe.scales == []


def test_stage_input_takes_one_tensor_or_a_list():
    stage = Linear()
    with pytest.raises(RuntimeError, match="needs set_input_tensor"):
        stage.stage_input()
    a, b = torch.ones(1), torch.zeros(1)
    stage.set_input_tensor(a)
    assert stage.stage_input() is a
    with pytest.raises(RuntimeError, match="needs set_input_tensor"):
        stage.stage_input(1)
    stage.set_input_tensor([a, b])
    assert stage.stage_input(0) is a and stage.stage_input(1) is b
    assert pipeline_stage(Wrapper(Wrapper(stage))) is stage


def test_a_moe_gpt_names_its_routers():
    flags = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 "
        "--vocab-size 64 --make-vocab-size-divisible-by 1 --num-experts 4 --moe-router-topk 2"
    ).split()
    (chunk,) = build_model(parse_config(flags, world_size=1), ParallelContext.single())
    routers = [layer.mlp.router for layer in chunk.decoder.layers.values()]
    assert chunk.aux_loss_modules() == routers and len(routers) == 2
