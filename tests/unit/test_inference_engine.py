"""Generation with the KV cache: equal to full recomputation and to Hugging Face `generate`,
mixed-length batches, continuous batching, per-sequence stopping, log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from gigatron.families.hf_mapping import gpt2_to_gigatron, llama_to_gigatron, model_config_from_hf
from gigatron.inference import InferenceEngine, KVCache, ModelRunner, SamplingParams
from gigatron.parallel.context import ParallelContext
from hf_helpers import gigatron_model, llama_gqa_config

VOCAB = 100
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7], [11, 12, 13], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def _gigatron_model(hf_config):
    return gigatron_model(model_config_from_hf(hf_config), finalize=False)


def gpt2_pair():
    torch.manual_seed(1)
    hf_config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf_model = GPT2LMHeadModel(hf_config).eval()
    model = _gigatron_model(hf_config)
    model.load_state_dict(gpt2_to_gigatron(hf_model.state_dict(), 2, 4, model.vocab_size))
    return model, hf_model


def llama_pair():
    torch.manual_seed(2)
    hf_config = llama_gqa_config(VOCAB)
    hf_model = LlamaForCausalLM(hf_config).eval()
    model = _gigatron_model(hf_config)
    model.load_state_dict(llama_to_gigatron(hf_model.state_dict(), 2, 8, 2, model.vocab_size))
    return model, hf_model


def engine_for(model, max_batch_size=2, max_sequence_length=64, tokenizer=None, stops=()):
    runner = ModelRunner(
        [model], ParallelContext.single(), VOCAB, max_batch_size, max_sequence_length
    )
    return InferenceEngine(runner, tokenizer, default_stop_token_ids=stops)


@torch.no_grad()
def recompute_greedy(model, prompt, steps):
    """Reference: the whole sequence through the model at every step, no cache."""
    ids, log_probs = list(prompt), []
    for _ in range(steps):
        tokens = torch.tensor([ids])
        logits = model(tokens, torch.arange(len(ids)).unsqueeze(0))[0, -1, :VOCAB].float()
        token = int(logits.argmax())
        log_probs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], log_probs


@pytest.mark.parametrize("pair", [gpt2_pair, llama_pair], ids=["gpt2", "llama-gqa"])
def test_greedy_cache_equals_recompute_and_hugging_face(pair):
    model, hf_model = pair()
    steps = 12
    # 4 prompts of different lengths through 2 slots: prompts join as slots free up.
    engine = engine_for(model, max_batch_size=2)
    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=True)
    completions = engine.generate(PROMPTS, params)
    for prompt, completion in zip(PROMPTS, completions):
        expected, expected_lp = recompute_greedy(model, prompt, steps)
        assert completion.output_ids == expected
        assert completion.finish_reason == "length"
        torch.testing.assert_close(completion.log_probs, expected_lp, rtol=0, atol=1e-4)
        hf_out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        assert hf_out[0, len(prompt) :].tolist() == expected


def test_one_batch_of_mixed_lengths_equals_one_at_a_time():
    model, _ = llama_pair()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    together = engine_for(model, max_batch_size=4).generate(PROMPTS, params)
    alone = [engine_for(model, max_batch_size=1).generate([p], params)[0] for p in PROMPTS]
    assert [c.output_ids for c in together] == [c.output_ids for c in alone]


def test_prompt_and_top_log_probs_match_the_full_forward():
    model, _ = gpt2_pair()
    engine = engine_for(model, max_batch_size=4)
    params = SamplingParams(
        max_tokens=3, temperature=0.0, logprobs=True, prompt_logprobs=True, top_logprobs=3
    )
    completions = engine.generate(PROMPTS[:3], params)
    for prompt, completion in zip(PROMPTS, completions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0))
        log_probs = torch.log_softmax(logits[0, :, :VOCAB].float(), -1)
        expected = [float(log_probs[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert len(completion.prompt_log_probs) == len(prompt) - 1
        torch.testing.assert_close(completion.prompt_log_probs, expected, rtol=0, atol=1e-4)
        values, ids = log_probs[-1].topk(3)
        first_top = completion.top_log_probs[0]
        assert [t for t, _ in first_top] == ids.tolist()
        torch.testing.assert_close([v for _, v in first_top], values.tolist(), rtol=0, atol=1e-4)
        assert first_top[0][0] == completion.output_ids[0]


def test_zero_tokens_returns_only_prompt_log_probs():
    model, _ = gpt2_pair()
    engine = engine_for(model)
    (completion,) = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=True)
    )
    assert completion.output_ids == [] and completion.finish_reason == "length"
    assert len(completion.prompt_log_probs) == len(PROMPTS[0]) - 1


class _DigitTokenizer:
    """Token t is the text str(t % 10), except `newline`, which is a newline."""

    def __init__(self, newline=None):
        self.newline = newline

    def tokenize(self, text):
        return [self.newline if ch == "\n" else int(ch) for ch in text]

    def detokenize(self, ids):
        return "".join("\n" if t == self.newline else str(t % 10) for t in ids)


def test_each_sequence_stops_on_its_own():
    model, _ = gpt2_pair()
    reference = engine_for(model, max_batch_size=4).generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=0.0)
    )
    free_run = reference[0].output_ids
    stop_token = free_run[3]
    cut_at = free_run.index(stop_token)
    tokenizer = _DigitTokenizer()
    text = tokenizer.detokenize(reference[2].output_ids)
    stop_string = text[4:6]
    engine = engine_for(model, max_batch_size=4, tokenizer=tokenizer)
    out = engine.generate(
        PROMPTS[:3],
        [
            SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_token,)),
            SamplingParams(max_tokens=4, temperature=0.0),
            SamplingParams(max_tokens=10, temperature=0.0, stop=(stop_string,)),
        ],
    )
    # stop token: the output ends before it, finish "stop"
    assert out[0].output_ids == free_run[:cut_at] and out[0].finish_reason == "stop"
    # max tokens: the other rows go on unaffected
    assert out[1].output_ids == reference[1].output_ids[:4] and out[1].finish_reason == "length"
    # stop string: text cut before its first occurrence
    assert out[2].finish_reason == "stop"
    assert out[2].text == text[: text.find(stop_string)]
    assert out[2].output_ids == reference[2].output_ids[: len(out[2].output_ids)]


def test_stop_on_eol_and_context_limit():
    model, _ = gpt2_pair()
    reference = engine_for(model, max_batch_size=1).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0)
    )[0]
    # Declare the third generated token a newline: generation stops right after it.
    newline = reference.output_ids[2]
    engine = engine_for(model, max_batch_size=1, tokenizer=_DigitTokenizer(newline))
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_on_eol=True)
    (out,) = engine.generate([PROMPTS[1]], params)
    assert out.output_ids == reference.output_ids[: reference.output_ids.index(newline) + 1]
    assert out.finish_reason == "stop" and out.text.endswith("\n")
    # The cache's length bounds a sequence: prompt + generated never exceeds it.
    short = engine_for(model, max_batch_size=1, max_sequence_length=10)
    (c,) = short.generate([PROMPTS[2]], SamplingParams(max_tokens=7, temperature=0.0))
    assert len(c.output_ids) == 7 and c.finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds the model's context"):
        short.submit(PROMPTS[2], SamplingParams(max_tokens=8))


def test_seeded_sampling_repeats_and_differs_by_seed():
    model, _ = llama_pair()
    engine = engine_for(model, max_batch_size=4)

    def run(seed):
        params = SamplingParams(max_tokens=10, temperature=1.5, top_k=20, seed=seed)
        return [c.output_ids for c in engine.generate(PROMPTS, params)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_kv_cache_holds_only_key_value_groups():
    model, _ = llama_pair()
    cache = KVCache([model], max_batch_size=3, max_sequence_length=20)
    assert set(cache.keys) == {1, 2}
    assert cache.keys[1].shape == (20, 3, 2, 8)  # 2 groups of 8 channels, not 8 heads
    assert cache.bytes() == 2 * 2 * 20 * 3 * 2 * 8 * 4
