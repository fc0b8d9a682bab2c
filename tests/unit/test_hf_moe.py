"""gigatron's MoE GPT equals Hugging Face Mixtral and Qwen2-MoE (shared expert with its gate,
dense and sparse layers mixed) given the same weights, random-initialised from small configs;
the maps go both ways."""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from gigatron.families.gpt.hf_moe import config_from_hf, gigatron_to_hf, hf_to_gigatron
from hf_helpers import assert_same_state, gigatron_model, hf_decoder, randomise, relative_error

VOCAB, SEQ = 100, 16


def _check(hf_model, hf_config) -> None:
    # Hugging Face initialises routers (Qwen2-MoE) and some weights to zeros: draw them all.
    randomise(hf_model, 0.1)
    hf_model.eval()
    model = gigatron_model(*config_from_hf(hf_config))
    model.load_state_dict(hf_to_gigatron(hf_model.state_dict(), hf_config, model.vocab_size))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    error = relative_error(logits, expected)
    assert error < 1e-4, error
    assert_same_state(gigatron_to_hf(model.state_dict(), hf_config), hf_model.state_dict())


def test_mixtral_same_logits_as_hugging_face():
    torch.manual_seed(0)
    hf_config = MixtralConfig(
        **hf_decoder(),
        vocab_size=VOCAB,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    _check(MixtralForCausalLM(hf_config), hf_config)


def test_qwen2_moe_with_shared_expert_same_logits_as_hugging_face():
    torch.manual_seed(0)
    hf_config = Qwen2MoeConfig(
        **hf_decoder(num_hidden_layers=3), vocab_size=VOCAB, intermediate_size=96,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
    )  # fmt: skip
    model_values, moe_values = config_from_hf(hf_config)
    assert moe_values["moe_layer_freq"] == "[1,0,1]"
    assert moe_values["moe_router_pre_softmax"] and model_values["add_qkv_bias"]
    _check(Qwen2MoeForCausalLM(hf_config), hf_config)
