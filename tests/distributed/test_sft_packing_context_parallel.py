"""Packed samples under context parallelism, split per document (each document padded to a
multiple of 2 cp and cut into 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r): at cp 2,
with each --cp-comm-type, the loss report and every gradient equal those of the same documents
trained one per sample in one process (relative 1e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gigatron.config.root import GigatronConfig
from gigatron.data.packing import first_fit_decreasing, packed_sample, padded_length
from gigatron.data.sft_dataset import Conversation, sft_sample
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads

pytestmark = pytest.mark.distributed

SEQ, VOCAB, CP = 32, 96, 2
LENGTHS = (13, 7, 22, 5, 9, 17)  # documents of varied lengths; none a multiple of 4 but one


def _config(cp: int, comm: str) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.seq_length = 2, 64, SEQ
    m.padded_vocab_size = 128
    m.attention_dropout = m.hidden_dropout = 0.0
    m.num_attention_heads, m.group_query_attention, m.num_query_groups = 4, True, 2
    m.position_embedding_type, m.swiglu, m.normalization = "rope", True, "RMSNorm"
    cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type = cp, [comm]
    return cfg


def _stack(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def _batches() -> tuple[dict, dict]:
    """(the documents packed for cp 2, the same documents one per sample)."""
    rng = np.random.default_rng(4)
    docs = [(rng.integers(0, VOCAB, n), rng.random(n) < 0.7) for n in LENGTHS]
    bins = first_fit_decreasing([padded_length(n, SEQ, 2 * CP) for n in LENGTHS], SEQ)
    assert len(bins) < len(LENGTHS)
    packed = _stack([packed_sample([docs[i] for i in b], SEQ, 0, 2 * CP) for b in bins])
    unpacked = _stack([sft_sample(Conversation(t, m), SEQ, 0) for t, m in docs])
    return packed, unpacked


def _step(cfg: GigatronConfig, pctx: ParallelContext, batch: dict):
    family = get_family("gpt")
    torch.manual_seed(0)
    (model,) = family.build_model(cfg, pctx, VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel)
    output, loss_fn = family.make_forward_step(cfg, pctx)(iter([batch]), chunk)
    loss, num_tokens, reports = loss_fn(output)
    (loss / num_tokens).backward()
    finalize_model_grads([chunk], pctx)
    return reports["lm_loss"], {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _compare(rank: int, world_size: int) -> None:
    packed, unpacked = _batches()
    ref_report, ref_grads = _step(_config(1, "p2p"), ParallelContext.single(), unpacked)
    assert float(ref_report[1]) > 0
    pctx = ParallelContext.from_sizes(cp=CP)
    for comm in ("p2p", "a2a", "allgather"):
        report, grads = _step(_config(CP, comm), pctx, dict(packed))
        torch.testing.assert_close(report, ref_report, rtol=1e-6, atol=0, msg=comm)
        for name, grad in grads.items():
            ref = ref_grads[name]
            atol = 1e-6 * float(ref.abs().max())
            torch.testing.assert_close(grad, ref, rtol=0, atol=atol, msg=f"{comm} {name}")


def test_packed_context_parallel_equals_unpacked_documents() -> None:
    run_distributed(_compare, CP)
