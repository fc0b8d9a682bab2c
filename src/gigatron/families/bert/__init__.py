"""The BERT family: a bidirectional encoder trained with masked-LM and (optionally) the binary
sentence-order head, on `[CLS] A [SEP] B [SEP]` samples from sentence-split data.

Losses (Megatron's): `mlm_loss`, the mean cross entropy over the masked tokens of a micro-batch,
plus `sop_loss`, the mean sentence-order cross entropy over its samples; the optimised loss is
their sum. Both are reported under their own names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.data.batch import get_batch
from gigatron.data.bert_dataset import build_bert_datasets
from gigatron.errors import GigatronError
from gigatron.families.bert.hf_bert import BertHFAdapter
from gigatron.families.gpt import token_losses
from gigatron.families.gpt.flops import model_flops_per_iteration
from gigatron.families.registry import ModelFamily
from gigatron.models.bert import build_bert_model
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.context_parallel import sequence_positions

BATCH_KEYS = ("tokens", "token_types", "labels", "loss_mask", "padding_mask", "is_random")


def bert_loss(
    batch: dict[str, torch.Tensor], pctx: ParallelContext, output
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """mlm (+ sop) loss of one micro-batch, already a mean: the schedule divides by 1.

    Under context parallelism each rank returns its part of the loss (the wrapper sums the
    gradients over cp): its masked tokens' share of the mlm mean over the whole sequences, and
    the sentence-order loss on cp rank 0 only, the one holding [CLS] (the others' pooler input is
    not [CLS]; weighted by 0 it gets no gradient). Reports are summed over cp."""
    lm_logits, binary_logits = output
    mask = batch["loss_mask"].float()
    lm_sum = torch.sum(token_losses(lm_logits, batch["labels"], pctx) * mask)
    mlm_report = torch.stack([lm_sum.detach(), mask.sum()])
    if pctx.cp_size > 1:
        pctx.all_reduce(mlm_report, "cp")
    loss = lm_sum / torch.clamp(mlm_report[1].clone(), min=1.0)
    reports = {"mlm_loss": mlm_report}
    if binary_logits is not None:
        sop_sum = F.cross_entropy(
            binary_logits.float(), batch["is_random"].reshape(-1), reduction="sum"
        )
        count = torch.tensor(float(binary_logits.shape[0]), device=sop_sum.device)
        if pctx.cp_rank > 0:
            sop_sum, count = sop_sum * 0.0, count * 0.0
        sop_report = torch.stack([sop_sum.detach(), count])
        if pctx.cp_size > 1:
            pctx.all_reduce(sop_report, "cp")
        reports["sop_loss"] = sop_report
        loss = loss + sop_sum / sop_report[1].clone()
    return loss, torch.ones((), device=loss.device), reports


def forward_step(
    pctx: ParallelContext, data_iterator: Iterator | None, model: nn.Module
) -> tuple[object, Callable]:
    """One micro-batch through one BERT chunk (schedule contract)."""
    batch = get_batch(data_iterator, pctx, BATCH_KEYS)
    tokens = batch["tokens"]
    batch_size, seq = tokens.shape
    positions = sequence_positions(seq, pctx, tokens.device).expand(batch_size, seq)
    # Padded keys are masked for every query ([b, 1, 1, s], True = masked); a padded query still
    # sees the real tokens, so no softmax row is empty. Under context parallelism the padding
    # mask covers the whole sequence (it is not split), as the keys do.
    attention_mask = (batch["padding_mask"] == 0)[:, None, None, :]
    output = model(tokens, positions, attention_mask, tokentype_ids=batch["token_types"])
    return output, partial(bert_loss, batch, pctx)


def make_forward_step(cfg, pctx: ParallelContext):
    return partial(forward_step, pctx)


def loss_names(cfg) -> tuple[str, ...]:
    return ("mlm_loss", "sop_loss") if cfg.model.bert_binary_head else ("mlm_loss",)


def build_datasets(cfg, tokenizer, num_samples, pctx=None):
    return build_bert_datasets(cfg, tokenizer, num_samples, pctx)


def flops_per_iteration(cfg, global_batch_size: int, padded_vocab_size: int) -> float:
    h = cfg.model.hidden_size
    # The masked-LM head's dense layer runs on every token before the output layer.
    return model_flops_per_iteration(
        cfg.model, global_batch_size, padded_vocab_size, head_flops_per_token=2.0 * h * h
    )


# Beyond the common core: the sentence-order head and the masking of the masked-LM data.
ACCEPTED_FIELDS = frozenset({"bert_binary_head", "mask_prob", "short_seq_prob"})


def validate(cfg) -> None:
    if cfg.model.post_layernorm and cfg.model.apply_residual_connection_post_layernorm:
        raise GigatronError(
            "--post-layernorm and --apply-residual-connection-post-layernorm: the second only "
            "applies to pre-norm layers; keep one"
        )


HF_ADAPTER = BertHFAdapter()
DEFAULT_TOKENIZER_TYPE = "BertWordPieceLowerCase"


FAMILY = ModelFamily.from_namespace(
    globals(),
    description="bidirectional encoder, masked-LM + sentence-order prediction (BERT)",
    build_model=build_bert_model,
)
