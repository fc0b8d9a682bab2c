"""The GPT family: decoder-only language models (GPT-2/3, Llama, Mistral, Qwen style).

The forward step turns a batch into vocab-parallel logits and the masked mean token loss,
reported as `lm_loss`; the loss never gathers the full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from gigatron.data.batch import get_batch
from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.sft_dataset import build_sft_datasets
from gigatron.families.gpt.flops import model_flops_per_iteration
from gigatron.families.gpt.hf_gpt import GPTHFAdapter
from gigatron.families.registry import ModelFamily
from gigatron.models.gpt import build_model
from gigatron.models.moe import MoESpec, collect_moe_reports, update_expert_bias
from gigatron.models.moe import report_names as moe_report_names
from gigatron.models.mtp import shift_left
from gigatron.models.transformer_config import MLA_FIELDS
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import vocab_parallel_cross_entropy

# document_start: packed samples' documents, for the context-parallel split per document.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "document_start")


def token_losses(logits: torch.Tensor, labels: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Per-token cross entropy [b, s] (float32) of vocab-parallel `logits` [b, s, vocab/tp]."""
    # The model returns a transposed view of [s, b, v]; transposing back is free.
    return vocab_parallel_cross_entropy(logits.transpose(0, 1), labels.t(), pctx).t()


def language_model_loss(
    labels: torch.Tensor, loss_mask: torch.Tensor, pctx: ParallelContext, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked sum of per-token cross entropies, the token count, and both (detached) as the
    `lm_loss` report.

    Under context parallelism each rank holds part of every sequence: the loss sum stays this
    rank's part (its gradient is summed over cp by the data-parallel wrapper), the token count
    and the report are the whole sequences' (summed over cp), so the per-token mean is the
    same as at cp = 1."""
    return masked_loss(token_losses(logits, labels, pctx), loss_mask, pctx)


def masked_loss(
    losses: torch.Tensor, loss_mask: torch.Tensor, pctx: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`language_model_loss` of per-token losses [b, s] (the model computed them: the fused
    output layer and loss)."""
    mask = loss_mask.float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    report = torch.stack([loss_sum.detach(), num_tokens.detach()])
    if pctx.cp_size > 1:
        pctx.all_reduce(report, "cp")
        num_tokens = report[1].clone()
    return loss_sum, num_tokens, {"lm_loss": report}


def multi_token_prediction_loss(
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    pctx: ParallelContext,
    depth_logits: list[torch.Tensor],
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaling_factor / D x the sum over depths of each depth's masked mean loss, the
    `mtp_loss` report [loss sum, tokens] over all depths). Depth k predicts the labels shifted
    k positions left, under the loss mask shifted likewise (Megatron's roll)."""

    mask = loss_mask.float()
    total = torch.zeros((), dtype=torch.float32, device=mask.device)
    report = torch.zeros(2, dtype=torch.float32, device=mask.device)
    for depth, logits in enumerate(depth_logits, start=1):
        depth_mask = shift_left(mask, depth)
        losses = token_losses(logits, shift_left(labels, depth), pctx) * depth_mask
        loss_sum, tokens = losses.sum(), depth_mask.sum()
        total = total + loss_sum / tokens.clamp(min=1)
        report += torch.stack([loss_sum.detach(), tokens])
    return total * (scaling_factor / len(depth_logits)), report


def gpt_loss(
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    pctx: ParallelContext,
    mtp_scaling_factor: float,
    output: torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`language_model_loss`, plus with multi-token prediction (the model's output is then
    `(logits, depth_logits)`) the MTP loss, added as the per-token mean it is (x the token
    count, since the schedule divides by it), and its `mtp_loss` report."""
    if not isinstance(output, tuple):
        return language_model_loss(labels, loss_mask, pctx, output)
    logits, depth_logits = output
    loss_sum, num_tokens, reports = language_model_loss(labels, loss_mask, pctx, logits)
    mtp_mean, mtp_report = multi_token_prediction_loss(
        labels, loss_mask, pctx, depth_logits, mtp_scaling_factor
    )
    return loss_sum + num_tokens * mtp_mean, num_tokens, {**reports, "mtp_loss": mtp_report}


def forward_step(
    pctx: ParallelContext,
    data_iterator: Iterator | None,
    model: nn.Module,
    mtp_scaling_factor: float = 0.1,
    loss_in_model: bool = False,
    model_inputs: tuple[str, ...] = (),
) -> tuple[torch.Tensor, Callable]:
    """One micro-batch through one model chunk (schedule contract). `loss_in_model`: the last
    stage computes the per-token losses itself (GPT without MTP, or Retro with
    `--cross-entropy-loss-fusion`). `model_inputs`:
    more batch keys the model takes by name (Retro's `neighbour_tokens`)."""
    batch = get_batch(data_iterator, pctx, (*BATCH_KEYS, *model_inputs))
    inputs = {name: batch[name] for name in model_inputs}
    if loss_in_model:
        inputs["labels"] = batch["labels"]
    output = model(
        batch["tokens"], batch["position_ids"], attention_mask=batch.get("attention_mask"), **inputs
    )
    if loss_in_model:
        return output, partial(masked_loss, loss_mask=batch["loss_mask"], pctx=pctx)
    loss = partial(gpt_loss, batch["labels"], batch["loss_mask"], pctx, mtp_scaling_factor)
    return output, loss


def make_forward_step(cfg, pctx: ParallelContext):
    m = cfg.model
    return partial(
        forward_step,
        pctx,
        mtp_scaling_factor=m.mtp_loss_scaling_factor,
        # The last stage's model computes the per-token losses from its labels (as
        # Megatron-Core's GPTModel does): the logits never leave it, so the loss may write over
        # them (GPTModel.token_losses); with MTP the model returns every depth's logits.
        loss_in_model=not m.mtp_num_layers,
    )


def build_datasets(cfg, tokenizer, num_samples, pctx=None):
    if cfg.data.sft:
        return build_sft_datasets(cfg, tokenizer, num_samples, pctx)

    return build_gpt_datasets(cfg, tokenizer, num_samples, pctx)


def flops_per_iteration(cfg, global_batch_size: int, padded_vocab_size: int) -> float:
    return model_flops_per_iteration(
        cfg.model, global_batch_size, padded_vocab_size, moe=MoESpec.from_config(cfg)
    )


def loss_names(cfg) -> tuple[str, ...]:
    """`lm_loss`, `mtp_loss` with multi-token prediction, then the MoE layers' auxiliary losses
    and routing statistics (if any)."""
    moe = MoESpec.from_config(cfg)
    mtp = ("mtp_loss",) if cfg.model.mtp_num_layers else ()
    return ("lm_loss", *mtp, *(moe_report_names(moe) if moe is not None else ()))


def iteration_reports(cfg, pctx: ParallelContext, model_chunks: list[nn.Module]):
    """After each training iteration: MoE expert-bias update and the MoE reports."""
    moe = MoESpec.from_config(cfg)
    if moe is None:
        return {}
    update_expert_bias(model_chunks, pctx)
    return collect_moe_reports(model_chunks, pctx, moe)


# Beyond the common core: Mixture of Experts (every other MoE flag needs --num-experts),
# multi-latent attention, multi-token prediction, supervised fine-tuning data and per-token loss
# averaging (the other families refuse these when set).
ACCEPTED_FIELDS = frozenset(
    {
        *MLA_FIELDS,
        "num_experts",
        "mtp_num_layers",
        "mtp_loss_scaling_factor",
        "sft",
        "sft_pack_sequences",
        "sft_tokenizer_prompt_format",
        "calculate_per_token_loss",
    }
)


HF_ADAPTER = GPTHFAdapter()
GENERATION = True
DEFAULT_TOKENIZER_TYPE = "GPT2BPETokenizer"


FAMILY = ModelFamily.from_namespace(
    globals(),
    description="decoder-only language model (GPT-2/3, Llama, Mistral, Qwen style)",
    build_model=build_model,
)
