"""Speculative decoding with a draft model at tensor-parallel 2 and pipeline-parallel 2: the
target runs split over two processes, the draft as one full copy on rank 0, and the greedy
tokens equal the single-process static engine's without speculation."""

from __future__ import annotations

import pytest
import torch

from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams
from gigatron.inference.load import build_engine
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext, run_distributed
from parallel_helpers import tiny_tp_config

pytestmark = pytest.mark.distributed

VOCAB = 100
PROMPTS = [[5, 17, 42, 8, 91, 3, 61], [7], [11, 12, 13], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def _gpt(pctx: ParallelContext, tp: int, pp: int, layers: int = 2, seed: int = 1234):
    cfg = tiny_tp_config(64, tp, False)
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.model.num_layers, cfg.model.num_attention_heads = layers, 4
    cfg.model.position_embedding_type = "rope"
    cfg.model.init_method_std = 0.3
    cfg.training.seed = seed
    (chunk,) = build_model(cfg, pctx)
    return chunk.eval()


def _worker(rank: int, world_size: int, tp: int, pp: int) -> None:
    pctx = ParallelContext.from_sizes(tp=tp, pp=pp)
    single = ParallelContext.single()
    draft = _gpt(single, 1, 1, layers=1, seed=99) if rank == 0 else None
    engine = build_engine([_gpt(pctx, tp, pp)], pctx, max_batch_size=3, max_sequence_length=64,
                          vocab_size=VOCAB, draft=draft, num_speculative_tokens=2)  # fmt: skip
    if rank != 0:
        engine.runner.follow()
        return
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    static = InferenceEngine(ModelRunner([_gpt(single, 1, 1)], single, VOCAB, 2, 64))
    expected = [c.output_ids for c in static.generate(PROMPTS, greedy)]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=3)
    try:
        got = engine.generate(PROMPTS + PROMPTS[:1], [greedy] * 4 + [sampled])
    finally:
        engine.runner.stop_followers()
    assert [c.output_ids for c in got[:4]] == expected
    assert len({tuple(t) for t in expected}) > 1
    assert len(got[4].output_ids) == 8 and all(0 <= t < VOCAB for t in got[4].output_ids)
    stats = engine.stats()
    assert 0 < stats["speculative_accepted"] < stats["speculative_drafted"], stats


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_draft_speculation_at_tp2_and_pp2_gives_the_static_engines_tokens(tp, pp):
    torch.manual_seed(0)
    run_distributed(_worker, tp * pp, tp, pp)
