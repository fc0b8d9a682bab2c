"""GPT's part of the training loop: turn a data-loader batch into model inputs, run the model,
and reduce its per-token loss to what the schedule needs.

`forward_step(data_iterator, chunk)` follows the schedule contract (parallel/schedules.py): it
returns `(output, loss_fn)`; on the last pipeline stage `output` is the per-token loss
`[batch, seq]` and `loss_fn(output)` returns `(loss_sum, num_tokens, report)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from gigatron.parallel.context import ParallelContext

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def _to_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return value.to(device, non_blocking=True)


def get_batch(data_iterator: Iterator | None, pctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The next micro-batch as tensors on this rank's device.

    Every rank reads the same micro-batch of its data-parallel slice (the loader is
    deterministic), so nothing needs to be broadcast over the tensor-parallel group.
    """
    if data_iterator is None:
        raise RuntimeError("get_batch needs a data iterator on every rank that runs forward")
    raw = next(data_iterator)
    batch = {key: _to_tensor(raw[key], pctx.device) for key in BATCH_KEYS if key in raw}
    if pctx.cp_size > 1:
        from gigatron.parallel import context_parallel  # only present with the CP issue

        batch = context_parallel.get_batch_on_this_cp_rank(batch, pctx)
    return batch


def loss_fn(
    loss_mask: torch.Tensor, pctx: ParallelContext, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked sum of the per-token losses, the token count, and both (detached) for logging."""
    mask = loss_mask.reshape(-1).float()
    losses = output.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    report = torch.stack([loss_sum.detach(), num_tokens.detach()])
    if pctx.cp_size > 1:
        # Each context-parallel rank holds part of every sequence: the reported loss is the
        # sum over the group (the backward pass stays local).
        pctx.all_reduce(report, "cp")
    return loss_sum, num_tokens, {"lm_loss": report}


def forward_step(
    data_iterator: Iterator | None, model: nn.Module, pctx: ParallelContext
) -> tuple[torch.Tensor, Callable]:
    """One micro-batch through one model chunk (schedule contract)."""
    batch = get_batch(data_iterator, pctx)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
    )
    return output, partial(loss_fn, batch["loss_mask"], pctx)


def make_forward_step(pctx: ParallelContext) -> Callable[[Iterator | None, nn.Module], Any]:
    """forward_step bound to a context, with the `(data_iterator, chunk)` signature."""
    return partial(_forward_step_with_context, pctx)


def _forward_step_with_context(pctx: ParallelContext, data_iterator: Iterator | None, model):
    return forward_step(data_iterator, model, pctx)
