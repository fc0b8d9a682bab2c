"""The dynamic engine (paged KV cache, block scheduler): greedy tokens equal to the static engine
and to recomputing the whole sequence, for requests arriving at random steps, for GPT (learned
and rotary positions), grouped-query attention, multi-latent attention, sliding windows and a
hybrid Mamba stack; chunked prefill under a token budget; prefix caching (hits skip their
prefill); preemption when the pool is too small; the block accounting back to zero."""

from __future__ import annotations

import random

import pytest
import torch
from test_mamba_generation import hybrid_model

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams
from gigatron.inference.block_pool import BlockPool
from gigatron.inference.load import build_engine
from gigatron.inference.scheduler import DynamicSettings
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from helpers import TINY_MLA

VOCAB = 96
PROMPTS = [
    [5, 17, 42, 8, 91, 3, 61], [7], [11, 12, 13], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [5, 17, 42, 8, 91, 3, 61, 22, 23], [30, 31, 32, 33, 34],
]  # fmt: skip


def gpt_model(seed: int = 1, **model) -> torch.nn.Module:
    """A 2-layer GPT with hidden 64 whose weights are perturbed so that greedy tokens vary."""
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, 64
    m.max_position_embeddings = 64
    m.attention_dropout = m.hidden_dropout = 0.0
    for key, value in model.items():
        setattr(m, key, value)
    finalize_config(cfg)
    (chunk,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in chunk.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return chunk.eval()


MODELS = {
    "gpt-learned": lambda: gpt_model(),
    "llama-gqa": lambda: gpt_model(
        position_embedding_type="rope",
        num_query_groups=2,
        group_query_attention=True,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
    ),  # fmt: skip
    "mla": lambda: gpt_model(position_embedding_type="rope", **TINY_MLA),
    "window": lambda: gpt_model(position_embedding_type="rope", window_size="(3,0)"),
    "hybrid-mamba": lambda: hybrid_model("M*M-"),
}


def static_engine(model, slots: int = 2) -> InferenceEngine:
    runner = ModelRunner([model], ParallelContext.single(), VOCAB, slots, 64)
    return InferenceEngine(runner)


def dynamic_engine(model, slots: int = 3, **settings) -> InferenceEngine:
    values = dict(block_size=4, max_tokens=6, chunked_prefill=True) | settings
    return build_engine(
        [model], ParallelContext.single(), max_batch_size=slots, max_sequence_length=64,
        vocab_size=VOCAB, dynamic=DynamicSettings(**values),
    )  # fmt: skip


@torch.no_grad()
def recompute_greedy(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))[0, -1, :VOCAB]
        ids.append(int(logits.float().argmax()))
    return ids[len(prompt) :]


def run_with_random_arrivals(engine, prompts, params, seed: int = 0):
    """Submit each prompt at a random step of a running engine; the completions in order."""
    rng = random.Random(seed)
    arrivals = sorted(rng.randrange(12) for _ in prompts)
    pending = list(zip(arrivals, prompts))
    completions, step = [], 0
    while pending or engine.busy:
        while pending and pending[0][0] <= step:
            completions.append(engine.submit(pending.pop(0)[1], params))
        engine.step()
        step += 1
    return completions


def assert_pool_empty(engine):
    stats = engine.stats()
    assert stats["blocks_in_use"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["blocks_available"] == engine.scheduler.pool.usable


class _PlanRecorder:
    """Wraps a runner: keeps every plan it executes."""

    def __init__(self, runner):
        self.runner, self.plans = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        self.plans.append(plan)
        return self.runner.execute(plan)


@pytest.mark.parametrize("name", list(MODELS))
def test_dynamic_greedy_equals_static_and_recompute_under_random_arrivals(name):
    model = MODELS[name]()
    params = SamplingParams(max_tokens=9, temperature=0.0)
    expected = [c.output_ids for c in static_engine(model).generate(PROMPTS, params)]
    for prompt, tokens in zip(PROMPTS, expected):
        assert tokens == recompute_greedy(model, prompt, 9)
    assert len({tuple(t) for t in expected}) > 2  # the model does not repeat one answer
    prefix = "hybrid" not in name
    engine = dynamic_engine(model, prefix_caching=prefix)
    engine.runner = recorder = _PlanRecorder(engine.runner)
    for seed, budget in ((0, 6), (1, 24)):  # the larger budget packs prefills beside decodes
        engine.scheduler.max_tokens = budget
        got = run_with_random_arrivals(engine, PROMPTS, params, seed)
        assert [c.output_ids for c in got] == expected
        assert all(c.finish_reason == "length" for c in got)
        assert_pool_empty(engine)
    if prefix:  # the second run found the first run's prompt blocks
        assert engine.stats()["prefix_hit_blocks"] > 0
    # a new 16-token prompt beside two decoding requests: one packed step, without padding
    first = [engine.submit(p, params) for p in PROMPTS[1:3]]
    engine.step(), engine.step()
    fresh = list(range(40, 56))
    late = engine.submit(fresh, params)
    while engine.busy:
        engine.step()
    assert [c.output_ids for c in first] == expected[1:3]
    assert late.output_ids == recompute_greedy(model, fresh, 9)
    assert_pool_empty(engine)
    assert any(plan.packed for plan in recorder.plans) == ("hybrid" not in name)


def test_chunked_prefill_keeps_to_the_token_budget_and_mixes_decode_with_prefill():
    model = MODELS["llama-gqa"]()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected = [c.output_ids for c in static_engine(model).generate(PROMPTS, params)]
    engine = dynamic_engine(model, slots=4, max_tokens=5)
    engine.runner = recorder = _PlanRecorder(engine.runner)
    assert [c.output_ids for c in engine.generate(PROMPTS, params)] == expected
    sizes = [sum(len(t) for t in plan.tokens) for plan in recorder.plans]
    assert max(sizes) == 5
    # the 11-token prompt went in chunks, beside other requests' decode tokens
    long_rows = [
        (plan, row) for plan in recorder.plans for row, start in enumerate(plan.starts)
        if plan.tokens[row][0] == PROMPTS[3][0] and start == 0
    ]  # fmt: skip
    assert long_rows and len(long_rows[0][0].tokens[long_rows[0][1]]) < len(PROMPTS[3])
    mixed = [p for p in recorder.plans if min(map(len, p.tokens)) == 1 < max(map(len, p.tokens))]
    assert mixed  # decode tokens beside a prefill chunk
    # decode steps stay padded (each row reads only its own keys); mixed ones go packed
    assert not any(p.packed for p in recorder.plans if max(map(len, p.tokens)) == 1)
    assert any(p.packed for p in mixed)
    # without chunking a prompt longer than the budget still goes whole (past the budget)
    whole = dynamic_engine(model, slots=4, max_tokens=5, chunked_prefill=False)
    assert [c.output_ids for c in whole.generate(PROMPTS, params)] == expected
    assert_pool_empty(whole)


def test_prefix_hits_skip_their_prefill():
    model = MODELS["gpt-learned"]()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    shared = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # two full blocks of 4 and one more token
    prompts = [shared + [7, 7], shared + [8], shared[:8] + [0, 1, 2]]
    expected = [c.output_ids for c in static_engine(model).generate(prompts, params)]
    engine = dynamic_engine(model, slots=1, prefix_caching=True)
    engine.runner = recorder = _PlanRecorder(engine.runner)
    assert [c.output_ids for c in engine.generate(prompts, params)] == expected
    # the first prompt is computed from 0; the others start after the 2 cached blocks
    firsts = [plan.starts[0] for plan in recorder.plans if len(plan.tokens[0]) > 1]
    assert firsts[0] == 0 and firsts.count(8) == 2
    stats = engine.stats()
    assert stats["prefix_hit_blocks"] == 4 and stats["prefix_hit_tokens"] == 16
    assert_pool_empty(engine)
    # prompt log-probs need the whole prompt computed: no reuse, the same numbers
    with_lp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=True, logprobs=True)
    (reference,) = static_engine(model).generate([prompts[1]], with_lp)
    (got,) = engine.generate([prompts[1]], with_lp)
    torch.testing.assert_close(got.prompt_log_probs, reference.prompt_log_probs, atol=1e-5,
                               rtol=0)  # fmt: skip
    torch.testing.assert_close(got.log_probs, reference.log_probs, atol=1e-5, rtol=0)
    assert engine.stats()["prefix_hit_blocks"] == 4


def test_overload_preempts_and_every_request_finishes():
    model = MODELS["gpt-learned"]()
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(200)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    sampled = SamplingParams(max_tokens=5, temperature=1.0, top_k=10, seed=5)
    reference = static_engine(model, slots=32)
    expected = [c.output_ids for c in reference.generate(prompts, greedy)]
    expected_sampled = [c.output_ids for c in reference.generate(prompts[:24], sampled)]
    # 12 blocks of 4 positions (11 usable) for 16 request slots: far too few for them all
    per_block = 2 * 2 * 64 * 4 * 4  # layers x (keys, values) x hidden x float32 x block
    engine = dynamic_engine(model, slots=16, buffer_bytes=12 * per_block, max_tokens=64)
    assert engine.scheduler.pool.num_blocks == 12
    got = engine.generate(prompts, greedy)
    assert [c.output_ids for c in got] == expected
    assert all(c.finish_reason == "length" for c in got)
    assert engine.stats()["preemptions"] > 0
    assert_pool_empty(engine)
    got = engine.generate(prompts[:24], sampled)  # seeded sampling survives recomputation
    assert [c.output_ids for c in got] == expected_sampled
    with pytest.raises(ValueError, match="needs 12 KV blocks of 4 tokens; the pool holds 11"):
        engine.submit([1] * 36, SamplingParams(max_tokens=12))


def test_block_pool_reference_counts_and_evicts_least_recently_used():
    pool = BlockPool(4, 2, prefix_caching=True)  # blocks 1, 2, 3
    a = pool.allocate(2)
    pool.register([1, 2, 3, 4], a)
    pool.release(a)
    assert pool.in_use() == 0 and pool.available() == 3 and pool.cached() == 2
    assert pool.match_prefix([1, 2, 3, 4, 5], 2) == a  # both blocks, referenced again
    assert pool.match_prefix([1, 2, 9, 9], 2) == a[:1]  # the first block, shared
    assert pool.in_use() == 2
    pool.release(a + a[:1])
    assert pool.counters.prefix_hit_blocks == 3
    # a[1] went idle before a[0]: it is the first evicted once the free block is taken
    fresh = pool.allocate(2)
    assert fresh[0] not in a and fresh[1] == a[1] and pool.counters.evictions == 1
    assert pool.match_prefix([1, 2, 3, 4], 2) == a[:1]  # the second block is gone
    assert pool.allocate(1) is None and pool.available() == 0
    pool.release(a[:1])
    assert pool.allocate(1) == a[:1] and pool.cached() == 0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([fresh[0], fresh[0]])


def test_multi_latent_attention_blocks_hold_latents_not_keys_and_values():
    model = MODELS["mla"]()
    engine = dynamic_engine(model, block_size=4)
    cache = engine.runner.cache
    latent = TINY_MLA["kv_lora_rank"] + TINY_MLA["qk_pos_emb_head_dim"]  # 16 + 8 per position
    assert cache.keys[1].shape == (cache.num_blocks * 4, 1, latent)
    assert cache.values[1].numel() == 0
    static = static_engine(model).runner.cache
    heads = 4 * (8 + 8) + 4 * 12  # per position: every head's key and value
    assert static.keys[1][0, 0].numel() + static.values[1][0, 0].numel() == heads
    assert cache.bytes() == 2 * cache.num_blocks * 4 * latent * 4
