"""Forward-backward schedules: the one entry point the training loop calls, whatever the
pipeline size.

A `forward_step(data_iterator, model_chunk)` returns `(output, loss_fn)`; on the last pipeline
stage `loss_fn(output)` returns `(loss_sum, num_tokens, report)`: the summed masked per-token loss
of the micro-batch, its token count, and a dict of detached values to log.
The schedule normalises the loss (by the token count unless `per_token_loss`, and by the number
of micro-batches), multiplies by the loss scale, and runs backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gigatron.parallel.context import ParallelContext

ForwardStep = Callable[[Iterator, nn.Module], tuple[torch.Tensor, Callable]]


@dataclass
class ScheduleConfig:
    """What the schedules need to know besides the model and the data."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    pipeline_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    per_token_loss: bool = False
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None


def _no_sync(chunk: nn.Module):
    return chunk.no_sync() if hasattr(chunk, "no_sync") else contextlib.nullcontext()


def compute_loss(
    output: torch.Tensor,
    loss_fn: Callable,
    num_microbatches: int,
    config: ScheduleConfig,
    forward_only: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Normalised, scaled loss to call backward on, and the report of this micro-batch."""
    loss_sum, num_tokens, report = loss_fn(output)
    report = dict(report)
    report.setdefault(
        "num_tokens", num_tokens.detach() if torch.is_tensor(num_tokens) else num_tokens
    )
    if config.per_token_loss:
        loss = loss_sum
    else:
        loss = loss_sum / torch.clamp(torch.as_tensor(num_tokens, dtype=loss_sum.dtype), min=1)
        loss = loss / num_microbatches
    if not forward_only and config.grad_scale_func is not None:
        loss = config.grad_scale_func(loss)
    return loss, report


def forward_backward_no_pipelining(
    forward_step: ForwardStep,
    data_iterator: Iterator,
    model_chunks: list[nn.Module],
    num_microbatches: int,
    pctx: ParallelContext,
    config: ScheduleConfig,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Gradient accumulation over micro-batches; gradient reduction only after the last one."""
    assert len(model_chunks) == 1, "without pipeline parallelism there is exactly one model chunk"
    (model,) = model_chunks
    reports = []
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        context = contextlib.nullcontext() if last or forward_only else _no_sync(model)
        with context:
            output, loss_fn = forward_step(data_iterator, model)
            loss, report = compute_loss(output, loss_fn, num_microbatches, config, forward_only)
            if not forward_only:
                loss.backward()
        reports.append(report)
    return reports


def forward_backward(
    forward_step: ForwardStep,
    data_iterator: Iterator | list[Iterator],
    model_chunks: list[nn.Module],
    num_microbatches: int,
    pctx: ParallelContext,
    config: ScheduleConfig,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Run one iteration's forward (and backward) passes; returns one report per micro-batch on
    the last pipeline stage (an empty list elsewhere)."""
    if pctx.pp_size == 1:
        return forward_backward_no_pipelining(
            forward_step, data_iterator, model_chunks, num_microbatches, pctx, config, forward_only
        )
    raise NotImplementedError("pipeline schedules land with the pipeline-parallel issue")
