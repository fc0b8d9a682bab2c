"""The GPT family: decoder-only language models (GPT-2/3, Llama, Mistral, Qwen style).

The forward step turns a batch into vocab-parallel logits and the masked mean token loss,
reported as `lm_loss`; the loss never gathers the full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from gigatron.checkpoint import hf_mapping
from gigatron.families.registry import ModelFamily
from gigatron.models.gpt import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import vocab_parallel_cross_entropy
from gigatron.training.batch import get_batch
from gigatron.training.flops import model_flops_per_iteration

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def token_losses(logits: torch.Tensor, labels: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Per-token cross entropy [b, s] (float32) of vocab-parallel `logits` [b, s, vocab/tp]."""
    # The model returns a transposed view of [s, b, v]; transposing back is free.
    return vocab_parallel_cross_entropy(logits.transpose(0, 1), labels.t(), pctx).t()


def language_model_loss(
    labels: torch.Tensor, loss_mask: torch.Tensor, pctx: ParallelContext, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked sum of per-token cross entropies, the token count, and both (detached) as the
    `lm_loss` report."""
    mask = loss_mask.float()
    loss_sum = torch.sum(token_losses(logits, labels, pctx) * mask)
    num_tokens = mask.sum()
    report = torch.stack([loss_sum.detach(), num_tokens.detach()])
    if pctx.cp_size > 1:
        # Each context-parallel rank holds part of every sequence: the reported loss is the
        # sum over the group (the backward pass stays local).
        pctx.all_reduce(report, "cp")
    return loss_sum, num_tokens, {"lm_loss": report}


def forward_step(
    pctx: ParallelContext, data_iterator: Iterator | None, model: nn.Module
) -> tuple[torch.Tensor, Callable]:
    """One micro-batch through one model chunk (schedule contract)."""
    batch = get_batch(data_iterator, pctx, BATCH_KEYS)
    output = model(
        batch["tokens"], batch["position_ids"], attention_mask=batch.get("attention_mask")
    )
    return output, partial(language_model_loss, batch["labels"], batch["loss_mask"], pctx)


def make_forward_step(cfg, pctx: ParallelContext):
    return partial(forward_step, pctx)


def build_datasets(cfg, tokenizer, num_samples, pctx=None):
    from gigatron.data.gpt_dataset import build_gpt_datasets

    return build_gpt_datasets(cfg, tokenizer, num_samples, pctx)


def flops_per_iteration(cfg, global_batch_size: int, padded_vocab_size: int) -> float:
    return model_flops_per_iteration(cfg.model, global_batch_size, padded_vocab_size)


FAMILY = ModelFamily(
    name="gpt",
    description="decoder-only language model (GPT-2/3, Llama, Mistral, Qwen style)",
    build_model=build_model,
    make_forward_step=make_forward_step,
    loss_names=lambda cfg: ("lm_loss",),
    build_datasets=build_datasets,
    flops_per_iteration=flops_per_iteration,
    hf_adapter=hf_mapping,
)
