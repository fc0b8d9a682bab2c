"""Tensor (and sequence) parallel GPTs equal the single-process model: logits, per-token loss and
every gradient (gathered to full tensors), for a Llama-style and a GPT-2-style model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.grad_sync import finalize_model_grads
from parallel_helpers import gather_tensor_parallel, tiny_tp_config

pytestmark = pytest.mark.distributed

SEQ, BATCH, VOCAB = 16, 2, 100


def _config(flavor: str, tp: int, sequence_parallel: bool) -> GigatronConfig:
    cfg = tiny_tp_config(SEQ, tp, sequence_parallel)
    m = cfg.model
    if flavor == "llama":
        m.num_attention_heads = 8
        m.group_query_attention, m.num_query_groups = True, 4
        m.position_embedding_type = "rope"
        m.rotary_percent = 0.5
        m.swiglu = True
        m.normalization = "RMSNorm"
        m.add_bias_linear = False
        m.untie_embeddings_and_output_weights = True
    else:
        m.num_attention_heads = 4
        m.apply_query_key_layer_scaling = True  # the explicit-softmax attention path
    return cfg


def _inputs(flavor: str):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = None
    if flavor == "gpt2":
        # Two documents per sample (reset attention mask): True = masked.
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        mask = causal.clone()
        mask[SEQ // 2 :, : SEQ // 2] = True
        mask = mask.expand(BATCH, 1, SEQ, SEQ)
    return tokens, labels, positions, mask


def _compare_with_single(rank: int, world_size: int) -> None:
    # One spawn of 4 processes covers tp = 2 (two data-parallel replicas) and tp = 4.
    for tp in (2, 4):
        _compare_layout(ParallelContext.from_sizes(tp=tp))


def _compare_layout(pctx: ParallelContext) -> None:
    world_size = pctx.tp_size
    single = ParallelContext.single()
    for flavor in ("llama", "gpt2"):
        tokens, labels, positions, mask = _inputs(flavor)
        (reference,) = build_model(_config(flavor, 1, False), single)
        ref_logits = reference(tokens, positions, mask)
        ref_loss = token_losses(reference(tokens, positions, mask), labels, single)
        ref_loss.sum().backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}

        for sequence_parallel in (False, True):
            case = f"{flavor} tp={world_size} sp={sequence_parallel}"
            (model,) = build_model(_config(flavor, world_size, sequence_parallel), pctx)
            for name, param in model.named_parameters():
                full = gather_tensor_parallel(param.detach(), param, pctx)
                assert torch.equal(full, dict(reference.named_parameters())[name]), (case, name)

            logits = model(tokens, positions, mask)
            assert logits.shape == (BATCH, SEQ, 128 // world_size), case
            full_logits = torch.cat(_all_gather(logits, pctx), dim=-1)
            torch.testing.assert_close(full_logits, ref_logits, rtol=1e-4, atol=1e-5, msg=case)

            loss = token_losses(model(tokens, positions, mask), labels, pctx)
            assert loss.dtype == torch.float32 and loss.shape == (BATCH, SEQ)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=case)
            with torch.no_grad():  # the model's own loss (--cross-entropy-loss-fusion's path)
                in_model = model(tokens, positions, mask, labels=labels)
            torch.testing.assert_close(in_model, ref_loss, rtol=1e-5, atol=1e-5, msg=case)
            loss.sum().backward()
            finalize_model_grads([model], pctx)
            for name, param in model.named_parameters():
                grad = gather_tensor_parallel(param.grad, param, pctx)
                torch.testing.assert_close(
                    grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}"
                )


def _all_gather(tensor: torch.Tensor, pctx: ParallelContext) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(pctx.tp_size)]
    dist.all_gather(parts, tensor, group=pctx.group("tp"))
    return parts


def test_tensor_and_sequence_parallel_match_single_process() -> None:
    run_distributed(_compare_with_single, 4)
