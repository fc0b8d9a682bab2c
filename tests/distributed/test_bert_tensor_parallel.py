"""Tensor (and sequence) parallel BERT equals the single-process model: masked-LM and
sentence-order logits, the BERT loss and every gradient (gathered to full tensors), pre-norm and
post-norm, with a padded sample."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.families.bert import bert_loss
from gigatron.models.bert import build_bert_model
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.grad_sync import finalize_model_grads
from parallel_helpers import gather_tensor_parallel

pytestmark = pytest.mark.distributed

SEQ, BATCH, VOCAB = 16, 3, 100


def _config(tp: int, sequence_parallel: bool, post_norm: bool) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, SEQ
    m.padded_vocab_size = 128
    m.attention_dropout = m.hidden_dropout = 0.0
    m.post_layernorm = post_norm
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.sequence_parallel = sequence_parallel
    return cfg


def _inputs():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    types = (torch.arange(SEQ) >= 6).long().expand(BATCH, SEQ)
    valid = torch.ones(BATCH, SEQ, dtype=torch.long)
    valid[2, 10:] = 0
    batch = {
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "loss_mask": (torch.rand(BATCH, SEQ, generator=g) < 0.3).float(),
        "is_random": torch.tensor([0, 1, 0]),
    }
    return tokens, types, (valid == 0)[:, None, None, :], batch


def _run(model, pctx):
    tokens, types, mask, batch = _inputs()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    output = model(tokens, positions, mask, tokentype_ids=types)
    loss, _, _ = bert_loss(batch, pctx, output)
    loss.backward()
    return output, loss


def _compare(rank: int, world_size: int) -> None:
    pctx = ParallelContext.from_sizes(tp=world_size)
    single = ParallelContext.single()
    for post_norm in (False, True):
        (reference,) = build_bert_model(_config(1, False, post_norm), single)
        (ref_lm, ref_sop), ref_loss = _run(reference, single)
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for sequence_parallel in (False, True):
            case = f"post_norm={post_norm} sp={sequence_parallel}"
            (model,) = build_bert_model(_config(world_size, sequence_parallel, post_norm), pctx)
            (lm, sop), loss = _run(model, pctx)
            parts = [torch.empty_like(lm.contiguous()) for _ in range(world_size)]
            dist.all_gather(parts, lm.contiguous(), group=pctx.group("tp"))
            torch.testing.assert_close(torch.cat(parts, -1), ref_lm, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(sop, ref_sop, rtol=1e-4, atol=1e-5, msg=case)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=case)
            finalize_model_grads([model], pctx)
            for name, param in model.named_parameters():
                grad = gather_tensor_parallel(param.grad, param, pctx)
                torch.testing.assert_close(
                    grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}"
                )


def test_tensor_and_sequence_parallel_bert_match_single_process() -> None:
    run_distributed(_compare, 2)
