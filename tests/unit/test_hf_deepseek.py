"""gigatron equals Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, random-initialised from a
small config): multi-latent attention with a query latent (and without), YaRN RoPE with
mscale, interleaved rotary weights, a dense first layer and an MoE layer with DeepSeek routing
and a shared expert. The maps go both ways; generation with the KV cache equals recomputation."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import hf_helpers
from gigatron.families.gpt.hf_deepseek import DeepseekV3HFAdapter
from gigatron.inference.kv_cache import KVCache

VOCAB, SEQ = 100, 16


def _hf_config(**overrides) -> DeepseekV3Config:
    values = dict(
        **hf_helpers.hf_decoder(num_key_value_heads=4, max_position_embeddings=128),
        vocab_size=VOCAB,
        intermediate_size=96,
        moe_intermediate_size=16,
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
    return hf_helpers.gigatron_model(*DeepseekV3HFAdapter().config_from_hf(hf_config))


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_same_logits_as_hugging_face(q_lora_rank):
    torch.manual_seed(0)
    hf_config = _hf_config(q_lora_rank=q_lora_rank)
    hf_model = DeepseekV3ForCausalLM(hf_config).eval()
    hf_helpers.randomise(hf_model, 0.2, norm_mean=1.0)
    with torch.no_grad():
        for layer in hf_model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    adapter = DeepseekV3HFAdapter()
    model = _gigatron(hf_config)
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), hf_config, model.vocab_size))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    error = hf_helpers.relative_error(logits, expected)
    assert error < 1e-5, error
    hf_helpers.assert_same_state(
        adapter.to_hf(model.state_dict(), hf_config), hf_model.state_dict()
    )

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
    torch.manual_seed(4)
    hf_config = _hf_config()
    hf_model = DeepseekV3ForCausalLM(hf_config).eval()
    hf_helpers.randomise(hf_model, 0.2, norm_mean=1.0)
    model = _gigatron(hf_config)
    model.load_state_dict(
        DeepseekV3HFAdapter().from_hf(hf_model.state_dict(), hf_config, model.vocab_size)
    )
    hf_helpers.assert_greedy_generation_matches(model, hf_model, VOCAB)
