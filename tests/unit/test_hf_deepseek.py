"""gigatron equals Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, random-initialised from a
small config): multi-latent attention with a query latent (and without), YaRN RoPE with
mscale, interleaved rotary weights, a dense first layer and an MoE layer with DeepSeek routing
and a shared expert. The maps go both ways; generation with the KV cache equals recomputation."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config, validate_config
from gigatron.families.gpt.hf_deepseek import DeepseekV3HFAdapter
from gigatron.inference.kv_cache import KVCache
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ = 100, 16


def _hf_config(**overrides) -> DeepseekV3Config:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 0.8,
            "mscale_all_dim": 0.6,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return DeepseekV3Config(**values)


def _gigatron(hf_config):
    model_values, moe_values = DeepseekV3HFAdapter().config_from_hf(hf_config)
    vocab = model_values.pop("vocab_size")
    cfg = GigatronConfig()
    for key, value in model_values.items():
        setattr(cfg.model, key, value)
    for key, value in moe_values.items():
        setattr(cfg.moe, key, value)
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    finalize_config(cfg)
    validate_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=vocab)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_same_logits_as_hugging_face(q_lora_rank):
    torch.manual_seed(0)
    hf_config = _hf_config(q_lora_rank=q_lora_rank)
    hf_model = DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(1.0, 0.2)
        for layer in hf_model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    adapter = DeepseekV3HFAdapter()
    model = _gigatron(hf_config)
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), hf_config, model.vocab_size))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    error = ((logits - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error

    back = adapter.to_hf(model.state_dict(), hf_config)
    reference = hf_model.state_dict()
    assert back.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)

    # Generation: prompt then one token at a time through the KV cache.
    with torch.no_grad():
        cache = KVCache([model], max_batch_size=2, max_sequence_length=SEQ)
        cache.begin_step([0, 1], [0, 0], [6, 6], 6, all_logits=True)
        steps = [model(tokens[:, :6], cache.position_ids([0, 0], 6), inference_cache=cache)]
        for position in range(6, SEQ):
            cache.begin_step([0, 1], [position] * 2, [1, 1], 1)
            steps.append(
                model(
                    tokens[:, position : position + 1],
                    cache.position_ids([position] * 2, 1),
                    inference_cache=cache,
                )
            )
    generated = torch.cat(steps, dim=1)[..., :VOCAB]
    torch.testing.assert_close(generated, logits, rtol=1e-4, atol=1e-5)


def test_generation_equals_hugging_face_generate():
    """The engine (MLA's KV cache, continuous batching over mixed prompt lengths) picks
    Hugging Face's greedy tokens."""
    from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams

    torch.manual_seed(4)
    hf_config = _hf_config()
    hf_model = DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model = _gigatron(hf_config)
    model.load_state_dict(
        DeepseekV3HFAdapter().from_hf(hf_model.state_dict(), hf_config, model.vocab_size)
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
