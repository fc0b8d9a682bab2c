"""Generation with hybrid Mamba models: the Mamba state cache (convolution window and scan state
per slot) gives the same tokens and log-probs as recomputing the whole sequence at every step,
for mixed-length batches, reused slots, prompts longer than a scan chunk and prompts fed in
pieces; a state that would have to be rewound is refused."""

from __future__ import annotations

import pytest
import torch

from gigatron.config import parse_config
from gigatron.inference import InferenceEngine, KVCache, ModelRunner, SamplingParams
from gigatron.models.hybrid import build_model
from gigatron.parallel.context import ParallelContext

VOCAB = 96
PROMPTS = [[5, 17, 42, 8, 91, 3, 61], [7], [11, 12, 13], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def hybrid_model(pattern: str = "M*M-", seed: int = 3):
    argv = [
        "--hybrid-layer-pattern", pattern, "--hidden-size", "64", "--num-attention-heads", "4",
        "--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
        "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type",
        "rope", "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size",
        str(VOCAB), "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--seed", str(seed),
    ]  # fmt: skip
    (model,) = build_model(parse_config(argv), ParallelContext.single(), vocab_size=VOCAB)
    torch.manual_seed(seed)
    with torch.no_grad():  # perturb every tensor (D, A, dt bias, norms) so each one matters
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return model.eval()


def engine_for(model, max_batch_size=2, max_sequence_length=128):
    runner = ModelRunner(
        [model], ParallelContext.single(), VOCAB, max_batch_size, max_sequence_length
    )
    return InferenceEngine(runner, None)


@torch.no_grad()
def recompute_greedy(model, prompt, steps):
    """Reference: the whole sequence through the model at every step, no cache."""
    ids, log_probs = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))[0, -1, :VOCAB]
        token = int(logits.float().argmax())
        log_probs.append(float(torch.log_softmax(logits.float(), -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], log_probs


@pytest.mark.parametrize("pattern", ["M*M-", "MM"], ids=["hybrid", "mamba-only"])
def test_greedy_with_the_state_cache_equals_recompute(pattern):
    model = hybrid_model(pattern)
    steps = 10
    # 4 prompts through 2 slots: later prompts reuse a slot whose state must start from zero.
    completions = engine_for(model).generate(
        PROMPTS, SamplingParams(max_tokens=steps, temperature=0.0, logprobs=True)
    )
    for prompt, completion in zip(PROMPTS, completions):
        expected, expected_lp = recompute_greedy(model, prompt, steps)
        assert completion.output_ids == expected
        torch.testing.assert_close(completion.log_probs, expected_lp, rtol=0, atol=1e-4)


def test_mixed_lengths_in_one_batch_equal_one_at_a_time_and_long_prompts_span_chunks():
    model = hybrid_model()
    long_prompt = [(7 * i + 3) % VOCAB for i in range(70)]  # longer than the scan's chunk (64)
    prompts = [*PROMPTS, long_prompt]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    together = engine_for(model, max_batch_size=len(prompts)).generate(prompts, params)
    alone = [engine_for(model, max_batch_size=1).generate([p], params)[0] for p in prompts]
    assert [c.output_ids for c in together] == [c.output_ids for c in alone]
    assert together[-1].output_ids == recompute_greedy(model, long_prompt, 6)[0]


def test_prompt_log_probs_match_the_full_forward():
    model = hybrid_model()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    completions = engine_for(model, max_batch_size=4).generate(PROMPTS, params)
    for prompt, completion in zip(PROMPTS, completions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0))
        log_probs = torch.log_softmax(logits[0, :, :VOCAB].float(), -1)
        expected = [float(log_probs[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        torch.testing.assert_close(completion.prompt_log_probs, expected, rtol=0, atol=1e-4)


@torch.no_grad()
def test_a_prompt_fed_in_pieces_continues_the_state_and_rewinding_is_refused():
    model = hybrid_model()
    prompt = torch.tensor([PROMPTS[3]])
    whole = model(prompt, torch.arange(prompt.shape[1]).unsqueeze(0))[0, -1]
    cache = KVCache([model], max_batch_size=2, max_sequence_length=32)
    for start, stop in ((0, 4), (4, 9), (9, 11)):  # slot 1, three steps of several tokens
        piece = prompt[:, start:stop]
        cache.begin_step([1], [start], [stop - start], stop - start)
        logits = model(piece, cache.position_ids([start], stop - start), inference_cache=cache)
    torch.testing.assert_close(logits[0, -1], whole, rtol=0, atol=1e-4)
    assert cache.mamba.fed[1] == 11
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.begin_step([1], [5], [1], 1)


def test_the_cache_holds_a_fixed_state_per_mamba_layer():
    model = hybrid_model("M*M-")
    cache = KVCache([model], max_batch_size=3, max_sequence_length=128)
    assert sorted(cache.mamba.ssm) == [1, 3] and sorted(cache.keys) == [2]
    # 8 heads of 16 x state 16 in float32; window 3 x (d_inner 128 + 2 groups x 2 x 16 state).
    assert cache.mamba.ssm[1].shape == (3, 8, 16, 16)
    assert cache.mamba.conv[1].shape == (3, 3, 128 + 64)
    attention = 2 * 128 * 3 * 4 * 16 * 4  # keys and values, float32
    mamba = 2 * (3 * 8 * 16 * 16 * 4 + 3 * 3 * 192 * 4)
    assert cache.bytes() == attention + mamba
