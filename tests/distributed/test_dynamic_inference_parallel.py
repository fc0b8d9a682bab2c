"""The dynamic engine (paged KV cache) at tensor-parallel 2 and pipeline-parallel 2 gives the
greedy tokens of the static engine on the single-process model, for sliding-window attention
(blocks freed out of the window), multi-latent attention (latents in the blocks) and a hybrid
Mamba stack (per-request states beside the blocks); the pool's accounting returns to zero."""

from __future__ import annotations

import pytest
import torch

from gigatron.config import parse_config
from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams
from gigatron.inference.load import build_engine
from gigatron.inference.scheduler import DynamicSettings
from gigatron.models import build_model
from gigatron.models.hybrid import build_model as build_hybrid
from gigatron.parallel.context import ParallelContext, run_distributed
from helpers import TINY_MLA
from parallel_helpers import tiny_tp_config

pytestmark = pytest.mark.distributed

VOCAB = 100
PROMPTS = [[5, 17, 42, 8, 91, 3, 61], [7], [11, 12, 13], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
FLAVORS = {
    "window": dict(num_attention_heads=4, position_embedding_type="rope", window_size="(3,0)"),
    "mla": dict(num_attention_heads=4, position_embedding_type="rope", **TINY_MLA),
}


def _gpt(flavor: str, pctx: ParallelContext, tp: int, pp: int):
    cfg = tiny_tp_config(64, tp, False)
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.model.init_method_std = 0.3
    cfg.model.max_position_embeddings = 64
    for key, value in FLAVORS[flavor].items():
        setattr(cfg.model, key, value)
    (chunk,) = build_model(cfg, pctx)
    return chunk.eval()


def _hybrid(pctx: ParallelContext, tp: int, pp: int):
    argv = [
        "--hybrid-layer-pattern", "M*M-", "--hidden-size", "64", "--num-attention-heads", "4",
        "--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
        "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type",
        "rope", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size",
        str(VOCAB), "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--init-method-std", "0.3",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
    ]  # fmt: skip
    (chunk,) = build_hybrid(parse_config(argv, world_size=tp * pp), pctx, vocab_size=VOCAB)
    return chunk.eval()


def _models(tp: int, pp: int, pctx: ParallelContext):
    single = ParallelContext.single()
    for flavor in FLAVORS:
        yield flavor, _gpt(flavor, single, 1, 1), _gpt(flavor, pctx, tp, pp)
    yield "hybrid", _hybrid(single, 1, 1), _hybrid(pctx, tp, pp)


def _worker(rank: int, world_size: int, tp: int, pp: int) -> None:
    pctx = ParallelContext.from_sizes(tp=tp, pp=pp)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    settings = DynamicSettings(block_size=4, max_tokens=6, chunked_prefill=True)
    for name, reference, model in _models(tp, pp, pctx):
        engine = build_engine([model], pctx, max_batch_size=3, max_sequence_length=64,
                              vocab_size=VOCAB, dynamic=settings)  # fmt: skip
        if rank != 0:
            engine.runner.follow()
            continue
        static = InferenceEngine(ModelRunner([reference], ParallelContext.single(), VOCAB, 2, 64))
        expected = [c.output_ids for c in static.generate(PROMPTS, params)]
        try:
            got = [c.output_ids for c in engine.generate(PROMPTS + PROMPTS[:2], params)]
        finally:
            engine.runner.stop_followers()
        # Released once: a second call (serve's engine thread and main thread both release)
        # sends nothing, or the followers' next loop would stop at once and this one wait.
        engine.runner.stop_followers()
        assert got == expected + expected[:2], name
        assert len({tuple(t) for t in expected}) > 1, name
        stats = engine.stats()
        assert stats["blocks_in_use"] == 0 and stats["running"] == 0, (name, stats)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_dynamic_engine_at_tp2_and_pp2_equals_the_static_engine(tp, pp):
    torch.manual_seed(0)
    run_distributed(_worker, tp * pp, tp, pp)
