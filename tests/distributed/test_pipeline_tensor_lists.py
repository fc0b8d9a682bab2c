"""Pipeline messages of several tensors (the contract T5 needs, for any model): a toy three-stage
model whose stages exchange lists of two tensors of different shapes, one of them passed on
unchanged by the middle stage (as T5's encoder output), gets under 1F1B the gradients and losses
of the same model run in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.parallel.schedules import ScheduleConfig, forward_backward

pytestmark = pytest.mark.distributed

HIDDEN, SEQ_A, SEQ_B, BATCH, MICROBATCHES = 8, 4, 6, 2, 4


class Stage(PipelineStage):
    """Stage 0: batch -> [tanh(W x), y * u]; stage 1: [a, b] -> [tanh(W a) + mean_s(b), b];
    stage 2: [c, b] -> sum(W c) * mean(b * u) (the loss)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(10 + index)
        self.index = index
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=generator) / 3)
        self.scale = nn.Parameter(torch.randn(HIDDEN, generator=generator))
        self.inputs: list[torch.Tensor] | None = None

    def set_input_tensor(self, tensors) -> None:
        assert isinstance(tensors, list) and len(tensors) == 2
        self.inputs = tensors

    def forward(self, batch, inputs=None):
        if self.index == 0:
            return [torch.tanh(batch["x"] @ self.weight), batch["y"] * self.scale]
        a, b = inputs if inputs is not None else self.inputs
        if self.index == 1:
            return [torch.tanh(a @ self.weight) + b.mean(0, keepdim=True) * self.scale, b]
        return (a @ self.weight).sum() * (b * self.scale).mean()


def microbatches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(SEQ_A, BATCH, HIDDEN, generator=generator),
         "y": torch.randn(SEQ_B, BATCH, HIDDEN, generator=generator)}
        for _ in range(MICROBATCHES)
    ]  # fmt: skip


def reference() -> list[dict[str, torch.Tensor]]:
    stages = [Stage(i) for i in range(3)]
    for batch in microbatches():
        out = stages[0](batch)
        out = stages[1](batch, out)
        (stages[2](batch, out) / MICROBATCHES).backward()
    return [{n: p.grad.clone() for n, p in stage.named_parameters()} for stage in stages]


def _run(rank: int, world_size: int, expected) -> None:
    pctx = ParallelContext.from_sizes(pp=3)
    stage = Stage(pctx.pp_rank)
    config = ScheduleConfig(
        seq_length=SEQ_A, micro_batch_size=BATCH, hidden_size=HIDDEN,
        stage_shapes=lambda r: [(SEQ_A, BATCH, HIDDEN), (SEQ_B, BATCH, HIDDEN)],
    )  # fmt: skip

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        output = chunk(batch)

        def loss_fn(loss):
            return loss, torch.tensor(1.0), {"loss": loss.detach()}

        return output, loss_fn

    reports = forward_backward(
        forward_step, iter(microbatches()), [stage], MICROBATCHES, pctx, config
    )
    assert len(reports) == (MICROBATCHES if pctx.pp_rank == 2 else 0)
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, expected[pctx.pp_rank][name], rtol=1e-5, atol=1e-6)


def test_lists_of_tensors_cross_stages_with_their_gradients():
    run_distributed(_run, 3, reference())
