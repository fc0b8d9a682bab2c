"""gigatron equals Hugging Face gpt-oss (`GptOssForCausalLM`, random-initialised from a small
config): learned softmax sinks, sliding windows on alternate layers, YaRN RoPE with a fractional
correction range, biases everywhere (router and experts too), MoE layers of clamped quick-GeGLU
experts with offset 1. The
sequence is longer than the window and YaRN interpolates part of the channels, so each feature matters;
the map goes both ways."""

from __future__ import annotations

import torch
from transformers import GptOssConfig, GptOssForCausalLM

import hf_helpers
from gigatron.families.gpt.hf_gpt_oss import GptOssHFAdapter

VOCAB, SEQ = 100, 24


def _hf_config(**overrides) -> GptOssConfig:
    values = dict(
        **hf_helpers.hf_decoder(max_position_embeddings=128),
        vocab_size=VOCAB,
        intermediate_size=48,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        swiglu_limit=0.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
        attn_implementation="eager",
    )
    values.update(overrides)
    return GptOssConfig(**values)


def _gigatron(hf_config, **overrides):
    return hf_helpers.gigatron_model(*GptOssHFAdapter().config_from_hf(hf_config), **overrides)


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ).expand(tokens.shape[0], SEQ))[..., :VOCAB]


def test_gpt_oss_same_logits_as_hugging_face():
    torch.manual_seed(0)
    hf_config = _hf_config()
    hf_model = GptOssForCausalLM(hf_config).eval()
    hf_helpers.randomise(hf_model, 0.2)
    adapter = GptOssHFAdapter()
    model = _gigatron(hf_config)
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), hf_config, model.vocab_size))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
    logits = _logits(model, tokens)
    error = hf_helpers.relative_error(logits, expected)
    assert error < 1e-5, error
    hf_helpers.assert_same_state(
        adapter.to_hf(model.state_dict(), hf_config), hf_model.state_dict()
    )

    # Each feature changes the logits: without it the model is not Hugging Face's.
    state = model.state_dict()
    for change in (
        dict(window_size=None, window_attn_skip_freq=None),
        dict(softmax_type="vanilla"),
        dict(activation_func_clamp_value=None),
        dict(yarn_correction_range_round_to_int=True),
    ):
        other = _gigatron(hf_config, **change)
        other.load_state_dict(state, strict=False)
        changed = hf_helpers.relative_error(_logits(other, tokens), expected)
        assert changed > 1e-3, change


def test_generation_equals_hugging_face_generate():
    """The engine (KV cache with sliding windows, continuous batching over mixed prompt
    lengths) picks Hugging Face's greedy tokens."""
    torch.manual_seed(3)
    hf_config = _hf_config()
    hf_model = GptOssForCausalLM(hf_config).eval()
    hf_helpers.randomise(hf_model, 0.2)
    model = _gigatron(hf_config)
    model.load_state_dict(
        GptOssHFAdapter().from_hf(hf_model.state_dict(), hf_config, model.vocab_size)
    )
    hf_helpers.assert_greedy_generation_matches(model, hf_model, VOCAB)
