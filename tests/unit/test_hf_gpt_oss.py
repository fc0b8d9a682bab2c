"""gigatron equals Hugging Face gpt-oss (`GptOssForCausalLM`, random-initialised from a small
config): learned softmax sinks, sliding windows on alternate layers, YaRN RoPE with a fractional
correction range, biases everywhere (router and experts too), MoE layers of clamped quick-GeGLU
experts with offset 1. The
sequence is longer than the window and YaRN interpolates part of the channels, so each feature matters;
the map goes both ways."""

from __future__ import annotations

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config, validate_config
from gigatron.families.gpt.hf_gpt_oss import GptOssHFAdapter
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ = 100, 24


def _hf_config(**overrides) -> GptOssConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=128,
        swiglu_limit=0.5,  # small enough that the clamp acts on these activations
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
    values, moe = GptOssHFAdapter().config_from_hf(hf_config)
    vocab = values.pop("vocab_size")
    cfg = GigatronConfig()
    for key, value in {**values, **overrides}.items():
        setattr(cfg.model, key, value)
    for key, value in moe.items():
        setattr(cfg.moe, key, value)
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    finalize_config(cfg)
    validate_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=vocab)
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ).expand(tokens.shape[0], SEQ))[..., :VOCAB]


def test_gpt_oss_same_logits_as_hugging_face():
    torch.manual_seed(0)
    hf_config = _hf_config()
    hf_model = GptOssForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    adapter = GptOssHFAdapter()
    model = _gigatron(hf_config)
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), hf_config, model.vocab_size))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
    logits = _logits(model, tokens)
    error = ((logits - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error

    back = adapter.to_hf(model.state_dict(), hf_config)
    reference = hf_model.state_dict()
    assert back.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)

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
        changed = ((_logits(other, tokens) - expected).norm() / expected.norm()).item()
        assert changed > 1e-3, change


def test_generation_equals_hugging_face_generate():
    """The engine (KV cache with sliding windows, continuous batching over mixed prompt
    lengths) picks Hugging Face's greedy tokens."""
    from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams

    torch.manual_seed(3)
    hf_config = _hf_config()
    hf_model = GptOssForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model = _gigatron(hf_config)
    model.load_state_dict(
        GptOssHFAdapter().from_hf(hf_model.state_dict(), hf_config, model.vocab_size)
    )
    runner = ModelRunner([model], ParallelContext.single(), VOCAB, 2, 48)
    engine = InferenceEngine(runner, None)
    prompts = [[5, 17, 42, 8, 99, 3, 61], [7], [11, 12, 13]]
    completions = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, completion in zip(prompts, completions, strict=True):
        hf_out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        assert completion.output_ids == hf_out[0, len(prompt) :].tolist()
