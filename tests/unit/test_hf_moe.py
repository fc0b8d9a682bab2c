"""gigatron's MoE GPT equals Hugging Face Mixtral and Qwen2-MoE (shared expert with its gate,
dense and sparse layers mixed) given the same weights, random-initialised from small configs;
the maps go both ways."""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config, validate_config
from gigatron.families.gpt.hf_moe import config_from_hf, gigatron_to_hf, hf_to_gigatron
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ = 100, 16


def _gigatron(hf_config):
    model_values, moe_values = config_from_hf(hf_config)
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


def _randomise(hf_model) -> None:
    # Hugging Face initialises routers (Qwen2-MoE) and some weights to zeros: draw them all.
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.1)


def _check(hf_model, hf_config) -> None:
    _randomise(hf_model)
    hf_model.eval()
    model = _gigatron(hf_config)
    model.load_state_dict(hf_to_gigatron(hf_model.state_dict(), hf_config, model.vocab_size))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    error = ((logits - expected).norm() / expected.norm()).item()
    assert error < 1e-4, error
    back = gigatron_to_hf(model.state_dict(), hf_config)
    reference = hf_model.state_dict()
    assert back.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)


def test_mixtral_same_logits_as_hugging_face():
    torch.manual_seed(0)
    hf_config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    _check(MixtralForCausalLM(hf_config), hf_config)


def test_qwen2_moe_with_shared_expert_same_logits_as_hugging_face():
    torch.manual_seed(0)
    hf_config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=64,
    )
    model_values, moe_values = config_from_hf(hf_config)
    assert moe_values["moe_layer_freq"] == "[1,0,1]"
    assert moe_values["moe_router_pre_softmax"] and model_values["add_qkv_bias"]
    _check(Qwen2MoeForCausalLM(hf_config), hf_config)
