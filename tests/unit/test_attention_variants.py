"""Attention and norm variants: query/key norms (= Hugging Face Qwen3), zero-centred norm
weights, off-by-one softmax, sliding windows (hand-built masks; KV-cache generation equals
recomputation), --no-position-embedding."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from gigatron.config.root import GigatronConfig, parse_config
from gigatron.config.validate import finalize_config
from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import llama_to_gigatron
from gigatron.inference.kv_cache import KVCache
from gigatron.models import build_model
from gigatron.models.transformer import CoreAttention, Norm
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from hf_helpers import hf_decoder

VOCAB = 100


def _cfg(**model) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, 16
    m.attention_dropout = m.hidden_dropout = 0.0
    for key, value in model.items():
        setattr(m, key, value)
    return finalize_config(cfg)


def test_qk_layernorm_same_logits_as_qwen3():
    torch.manual_seed(0)
    hf_config = Qwen3Config(
        **hf_decoder(),
        vocab_size=VOCAB,
        intermediate_size=96,
        head_dim=16,
        tie_word_embeddings=False,
    )
    hf_model = Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
    cfg = _cfg(
        group_query_attention=True, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
        position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-6,
        swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
        qk_layernorm=True, rotary_base=int(hf_config.rope_parameters["rope_theta"]),
    )  # fmt: skip
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    hf = hf_model.state_dict()
    sd = llama_to_gigatron(hf, 2, 4, 2, model.vocab_size)
    for i in range(2):
        for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            sd[f"decoder.layers.{i}.self_attention.{ours}.weight"] = hf[
                f"model.layers.{i}.self_attn.{theirs}.weight"
            ]
    model.load_state_dict(sd)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model.eval()(tokens, torch.arange(12).expand(2, 12))[..., :VOCAB]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_stores_the_weight_minus_one(kind):
    plain = TransformerConfig.from_config(_cfg(normalization=kind))
    one_p = TransformerConfig.from_config(
        _cfg(normalization=kind, layernorm_zero_centered_gamma=True)
    )
    pctx = ParallelContext.single()
    a, b = Norm(plain, pctx), Norm(one_p, pctx)
    assert torch.equal(b.weight, torch.zeros(64))  # starts as the identity scale
    with torch.no_grad():
        a.weight.copy_(torch.linspace(0.5, 1.5, 64))
        b.weight.copy_(torch.linspace(-0.5, 0.5, 64))
    x = torch.randn(3, 64)
    torch.testing.assert_close(a(x), b(x))


def _core(**model) -> CoreAttention:
    config = TransformerConfig.from_config(_cfg(**model))
    pctx = ParallelContext.single()
    return CoreAttention(config, pctx, 1, ModelParallelRNG.for_rank(0, pctx)).eval()


def test_off_by_one_softmax_adds_one_to_the_denominator():
    q, k, v = (torch.randn(5, 1, 4, 16) for _ in range(3))  # [s, b, heads, hn]
    out = _core(softmax_type="off-by-one")(q, k, v, None).view(5, 4, 16)
    for head in range(4):
        scores = q[:, 0, head] @ k[:, 0, head].t() / math.sqrt(16)
        weights = scores.exp().tril()  # causal
        weights = weights / (1.0 + weights.sum(-1, keepdim=True))
        torch.testing.assert_close(out[:, head], weights @ v[:, 0, head])


def test_sliding_window_masks_keys_outside_the_band():
    q, k, v = (torch.randn(7, 1, 4, 16) for _ in range(3))
    windowed = _core(window_size="(2,0)")
    out = windowed(q, k, v, None).view(7, 4, 16)
    for head in range(4):
        scores = q[:, 0, head] @ k[:, 0, head].t() / math.sqrt(16)
        i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
        scores = scores.masked_fill((j > i) | (j < i - 2), -math.inf)
        torch.testing.assert_close(out[:, head], scores.softmax(-1) @ v[:, 0, head])
    # A data mask keeps the band: key 0 hidden from everyone here too.
    mask = torch.zeros(1, 1, 7, 7, dtype=torch.bool)
    mask[..., 0] = True
    mask |= torch.ones(7, 7, dtype=torch.bool).triu(1)
    masked = windowed(q, k, v, mask).view(7, 4, 16)
    torch.testing.assert_close(masked[3:], out[3:])  # queries >= 3 never saw key 0
    assert not torch.allclose(masked[1], out[1])


def test_window_layers_follow_the_skip_frequency():
    config = TransformerConfig.from_config(
        _cfg(num_layers=4, window_size="(4,0)", window_attn_skip_freq="2")
    )
    assert [config.is_window_layer(n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    config = TransformerConfig.from_config(
        _cfg(num_layers=4, window_size="(4,0)", window_attn_skip_freq="[0,1]*2")
    )
    assert [config.is_window_layer(n) for n in (1, 2, 3, 4)] == [False, True, False, True]


def test_generation_with_windows_and_sinks_equals_recomputation():
    cfg = _cfg(
        position_embedding_type="rope",
        window_size="(3,0)",
        window_attn_skip_freq="2",
        softmax_type="learnable",
    )
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.eval()
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens, torch.arange(12)[None])
        cache = KVCache([model], max_batch_size=1, max_sequence_length=16)
        cache.begin_step([0], [0], [5], 5, all_logits=True)
        steps = [model(tokens[:, :5], cache.position_ids([0], 5), inference_cache=cache)]
        for position in range(5, 12):
            cache.begin_step([0], [position], [1], 1)
            token = tokens[:, position : position + 1]
            steps.append(model(token, cache.position_ids([position], 1), inference_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_no_position_embedding():
    cfg = parse_config(["--no-position-embedding"])
    assert finalize_config(cfg).model.position_embedding_type == "none"
    cfg = parse_config(["--no-position-embedding", "--position-embedding-type", "rope"])
    assert finalize_config(cfg).model.position_embedding_type == "rope"


def test_attention_variant_rules():
    with pytest.raises(GigatronError, match="--window-size 5"):
        parse_config(["--num-layers", "2", "--window-size", "5"])
    with pytest.raises(GigatronError, match="--rope-type yarn"):
        parse_config(["--rope-type", "yarn"])
    with pytest.raises(GigatronError, match="gated MLPs"):
        parse_config(["--glu-linear-offset", "1.0"])


@pytest.mark.parametrize("family", ["bert", "mamba"])
def test_multi_latent_attention_is_refused_outside_gpt(family):
    from gigatron.families import get_family
    from gigatron.families.accepted import check_family_config

    cfg = parse_config(["--multi-latent-attention", "--num-layers", "2"])
    with pytest.raises(GigatronError, match=rf"the {family} family does not use it \(only gpt"):
        check_family_config(get_family(family), cfg)
