"""Scoring token sequences with a language model: batched forward passes over this rank's model
chunks (through the pipeline schedule, so any tp/pp layout), samples split over data-parallel
ranks, and per-sample results gathered on every rank.

A sample is `tokens` (int, `[n + 1]`) and `loss_mask` (`[n]`): position i predicts
`tokens[i + 1]` and counts when `loss_mask[i]` is 1. Its score is the summed cross entropy of the
counted positions and whether every counted position's arg-max is the target (greedy)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gigatron.families.gpt import token_losses
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.schedules import ScheduleConfig, forward_backward


@dataclass
class Sample:
    tokens: np.ndarray  # int64 [n + 1]
    loss_mask: np.ndarray  # float32 [n]


def greedy_matches(
    logits: torch.Tensor, labels: torch.Tensor, pctx: ParallelContext
) -> torch.Tensor:
    """[b, s] bool: the target's logit is the largest of the (vocab-parallel) logits."""
    logits = logits.float()
    local_max = logits.max(dim=-1).values
    vocab_per_rank = logits.shape[-1]
    start = pctx.tp_rank * vocab_per_rank
    local = labels - start
    inside = (local >= 0) & (local < vocab_per_rank)
    target = torch.gather(logits, -1, local.clamp(0, vocab_per_rank - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(inside, target, torch.zeros_like(target))
    if pctx.size("tp") > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=pctx.group("tp"))
        dist.all_reduce(target, group=pctx.group("tp"))
    return target >= local_max


def _batches(samples: Sequence[Sample], batch_size: int, length: int) -> Iterator[dict]:
    for start in range(0, len(samples), batch_size):
        part = samples[start : start + batch_size]
        tokens = np.zeros((batch_size, length + 1), dtype=np.int64)
        mask = np.zeros((batch_size, length), dtype=np.float32)
        for row, sample in enumerate(part):
            n = len(sample.loss_mask)
            tokens[row, : n + 1] = sample.tokens
            mask[row, :n] = sample.loss_mask
        yield {"tokens": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(mask)}


def score_samples(
    model_chunks: list[nn.Module],
    pctx: ParallelContext,
    samples: Sequence[Sample],
    micro_batch_size: int,
    seq_length: int | None = None,
    pipeline_dtype: torch.dtype = torch.float32,
    on_batch: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """[len(samples), 3] float64 on every rank: summed loss, counted tokens, 1.0 if greedy.

    Samples are padded to `seq_length` (default: the longest sample); data-parallel rank r takes
    the r-th contiguous block. `on_batch(done, total)` is called on each micro-batch (progress)."""
    n = len(samples)
    longest = max((len(s.loss_mask) for s in samples), default=1)
    length = seq_length or longest
    if longest > length:
        raise ValueError(f"a sample of {longest} tokens does not fit in {length}")
    dp, per_step = pctx.dp_size, micro_batch_size
    per_rank = math.ceil(n / dp / per_step) * per_step if n else per_step
    mine = list(samples[pctx.dp_rank * per_rank : (pctx.dp_rank + 1) * per_rank])
    empty = Sample(np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.float32))
    mine += [empty] * (per_rank - len(mine))
    num_batches = per_rank // per_step
    results: list[torch.Tensor] = []
    device = pctx.device

    def forward_step(iterator: Iterator, chunk: nn.Module):
        batch = next(iterator)
        tokens = batch["tokens"].to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        mask = batch["loss_mask"].to(device)
        positions = torch.arange(length, device=device).unsqueeze(0).expand_as(inputs)
        output = chunk(inputs, positions)

        def loss_fn(logits: torch.Tensor):
            losses = token_losses(logits, labels, pctx) * mask
            greedy = greedy_matches(logits, labels, pctx) | (mask == 0)
            row = torch.stack(
                [losses.sum(-1).double(), mask.sum(-1).double(), greedy.all(-1).double()], dim=-1
            )
            results.append(row)
            total = losses.sum()
            return total, mask.sum(), {"lm_loss": torch.stack([total, mask.sum()]).detach()}

        return output, loss_fn

    config = ScheduleConfig(
        seq_length=length,
        micro_batch_size=per_step,
        hidden_size=model_chunks[0].config.hidden_size,
        pipeline_dtype=pipeline_dtype,
    )
    # Several micro-batches per schedule call keep every pipeline stage busy.
    group = 4 * pctx.pp_size
    batches = _batches(mine, per_step, length)
    with torch.no_grad():
        for done in range(0, num_batches, group):
            count = min(group, num_batches - done)
            forward_backward(forward_step, batches, model_chunks, count, pctx, config, True)
            if on_batch is not None:
                on_batch(done + count, num_batches)
    local = torch.cat(results) if results else torch.zeros(per_rank, 3, dtype=torch.float64)
    local = local.to(device)
    if pctx.size("pp") > 1:
        # Only the last stage computed the scores; the other stages add zeros.
        if not pctx.is_pipeline_last_stage():
            local.zero_()
        dist.all_reduce(local, group=pctx.group("pp"))
    if dp > 1:
        gathered = [torch.empty_like(local) for _ in range(dp)]
        dist.all_gather(gathered, local, group=pctx.group("dp"))
        local = torch.cat(gathered)
    return local[:n].cpu()
