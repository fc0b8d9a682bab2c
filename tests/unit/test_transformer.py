"""Single-process tests of the transformer blocks, the GPT chunks and their layout rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gigatron.config.presets import apply_preset
from gigatron.config.root import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.models.presets import main as presets_main
from gigatron.models.transformer import RotaryEmbedding, apply_rotary
from gigatron.parallel.context import Grid, ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import (
    _VocabParallelCrossEntropy,
    merge_partitions,
    padded_vocab_size,
    slice_for_rank,
    vocab_parallel_cross_entropy,
)

SEQ, BATCH = 16, 2


def _lm_losses(logits, labels):
    """Per-token losses [b, s] of a GPT chunk's logits (the GPT family's loss)."""
    return token_losses(logits, labels, ParallelContext.single())


def tiny_config(**model_overrides) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, SEQ
    m.padded_vocab_size = 128
    m.attention_dropout = m.hidden_dropout = 0.0
    for key, value in model_overrides.items():
        setattr(m, key, value)
    return cfg


LLAMA = dict(
    num_attention_heads=8, group_query_attention=True, num_query_groups=2,
    position_embedding_type="rope", swiglu=True, normalization="RMSNorm", add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)  # fmt: skip


def fake_context(tp: int = 1, pp: int = 1, rank: int = 0) -> ParallelContext:
    """A context of one rank of a larger layout, enough to build (not run collectives)."""
    return ParallelContext(grid=Grid(tp=tp, pp=pp), rank=rank)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 100, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels


def test_padded_vocab_size_follows_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(100, 8, 4) == 128
    assert padded_vocab_size(128, 128, 1) == 128


def test_cross_entropy_and_gradient_match_torch_at_tp1():
    logits = torch.randn(5, 3, 11, requires_grad=True)
    labels = torch.randint(0, 11, (5, 3))
    # The vocab-parallel Function itself (tp = 1 takes torch's fused path, checked too).
    loss = _VocabParallelCrossEntropy.apply(logits, labels, None, 1, 0)
    fused = vocab_parallel_cross_entropy(logits, labels, ParallelContext.single())
    weights = torch.rand(5, 3)
    (loss * weights).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 11), labels.view(-1), reduction="none").view(5, 3)
    (ref * weights).sum().backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(fused, ref)
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_strided_slices_hold_a_slice_of_each_block():
    full = torch.arange(8).view(8, 1)  # [gate 0..3; up 4..7]
    parts = [slice_for_rank(full, 0, 2, r, 2) for r in range(2)]
    assert parts[0].flatten().tolist() == [0, 1, 4, 5]
    assert parts[1].flatten().tolist() == [2, 3, 6, 7]
    assert torch.equal(merge_partitions(parts, 0, 2), full)


@pytest.mark.parametrize("overrides", [{}, LLAMA])
def test_tensor_parallel_slices_reassemble_the_single_model(overrides):
    (single,) = build_model(tiny_config(**overrides), ParallelContext.single())
    ranks = [build_model(tiny_config(**overrides), fake_context(tp=2, rank=r))[0] for r in range(2)]
    params = [dict(m.named_parameters()) for m in ranks]
    for name, param in single.named_parameters():
        local = params[0][name]
        if local.tensor_model_parallel:
            full = merge_partitions(
                [p[name] for p in params], local.partition_dim, local.partition_stride
            )
        else:
            full = local
        assert torch.equal(full, param), name
    fc1 = params[0]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.partition_stride == (2 if overrides else 1)


def test_pipeline_chunks_have_global_names_and_tied_copy():
    cfg = tiny_config(num_layers=4)
    (single,) = build_model(cfg, ParallelContext.single())
    (first,) = build_model(cfg, fake_context(pp=2, rank=0))
    (last,) = build_model(cfg, fake_context(pp=2, rank=1))
    first_names, last_names = (
        set(dict(first.named_parameters())),
        set(dict(last.named_parameters())),
    )
    assert "decoder.layers.1.mlp.linear_fc2.weight" in first_names
    assert "decoder.layers.2.mlp.linear_fc2.weight" in last_names
    assert not any(n.startswith("decoder.layers.2") for n in first_names)
    assert "output_layer.weight" in last_names and "output_layer.weight" not in first_names
    assert first.pre_process and not first.post_process and last.post_process
    word = first.embedding.word_embeddings.weight
    assert torch.equal(last.output_layer.weight, word)
    assert word.shared_embedding and last.output_layer.weight.shared_embedding
    assert not getattr(single.embedding.word_embeddings.weight, "shared_embedding", False)

    tokens, positions, labels = batch()
    hidden = first(tokens, positions)
    assert hidden.shape == (SEQ, BATCH, 64)
    last.set_input_tensor(hidden)
    torch.testing.assert_close(
        _lm_losses(last(None, positions), labels), _lm_losses(single(tokens, positions), labels)
    )


def test_virtual_stages_interleave_layers():
    cfg = tiny_config(num_layers=8)
    cfg.parallel.num_virtual_stages_per_pipeline_rank = 2
    chunks = build_model(cfg, fake_context(pp=2, rank=0))
    layers = [list(c.decoder.layers.keys()) for c in chunks]
    assert layers == [["0", "1"], ["4", "5"]]
    assert chunks[0].pre_process and not chunks[1].pre_process and not chunks[1].post_process


def test_explicit_softmax_path_and_explicit_mask_match_sdpa():
    tokens, positions, labels = batch()
    (sdpa,) = build_model(tiny_config(**LLAMA), ParallelContext.single())
    (explicit,) = build_model(
        tiny_config(**LLAMA, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
        ParallelContext.single(),
    )
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ)
    expected = sdpa(tokens, positions)
    torch.testing.assert_close(explicit(tokens, positions), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sdpa(tokens, positions, causal), expected, rtol=1e-5, atol=1e-5)
    # A document boundary changes the second half's outputs and leaves the first half's.
    reset = causal.clone()
    reset[..., SEQ // 2 :, : SEQ // 2] = True
    out = explicit(tokens, positions, reset)
    torch.testing.assert_close(out[:, : SEQ // 2], expected[:, : SEQ // 2], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:, SEQ // 2 :], expected[:, SEQ // 2 :], atol=1e-3)


def test_rotary_rotates_only_its_share_of_channels():
    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_base=10000)
    x = torch.randn(3, 1, 2, 8)
    cos, sin = rotary(torch.arange(3).unsqueeze(0))
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[0], x[0])  # position 0: no rotation
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))
    # Position 1, first pair: angle 1 rad (inv_freq[0] = 1).
    a, b = x[1, 0, 0, 0], x[1, 0, 0, 2]
    expected = a * torch.cos(torch.tensor(1.0)) - b * torch.sin(torch.tensor(1.0))
    torch.testing.assert_close(out[1, 0, 0, 0], expected)


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="selective"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    ],
)
def test_recompute_gives_identical_gradients_with_dropout(recompute):
    dropout = dict(attention_dropout=0.3, hidden_dropout=0.3)
    tokens, positions, labels = batch()
    results = []
    for extra in ({}, recompute):
        (model,) = build_model(tiny_config(**LLAMA, **dropout, **extra), ParallelContext.single())
        model.train()
        torch.manual_seed(5)
        loss = _lm_losses(model(tokens, positions), labels)
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)
    # Dropout really is on: a second draw differs.
    assert not torch.equal(_lm_losses(model(tokens, positions), labels).detach(), loss_b)


def test_model_parallel_stream_is_separate_from_the_default():
    rng = ModelParallelRNG(seed=42)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with rng.fork():
        forked = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)  # the default stream did not advance
    with rng.fork():
        second = torch.rand(4)
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(42)))
    assert not torch.equal(forked, second)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(GigatronError, match="num-query-groups"):
        build_model(tiny_config(**LLAMA), fake_context(tp=4))
    with pytest.raises(GigatronError, match="flash-attn"):
        build_model(tiny_config(use_flash_attn=True), ParallelContext.single())
    with pytest.raises(GigatronError, match="vocabulary size is unknown"):
        build_model(tiny_config(padded_vocab_size=None), ParallelContext.single())
    with pytest.raises(GigatronError, match="llama2-7b"):
        apply_preset(GigatronConfig(), "llama-9000")


def test_presets_fill_only_defaults_and_list_counts(capsys):
    cfg = GigatronConfig()
    cfg.model.num_layers = 3
    apply_preset(cfg, "llama2-70b")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.swiglu) == (3, 8192, 8, True)
    assert presets_main([]) == 0
    table = capsys.readouterr().out
    assert "| llama2-7b |" in table and "6.74B" in table and "124.48M" in table


def test_bf16_model_returns_float32_loss_close_to_fp32():
    tokens, positions, labels = batch()
    (fp32,) = build_model(tiny_config(**LLAMA), ParallelContext.single())
    cfg = tiny_config(**LLAMA)
    cfg.training.bf16 = True
    (bf16,) = build_model(cfg, ParallelContext.single())
    assert bf16.embedding.word_embeddings.weight.dtype == torch.bfloat16
    loss = _lm_losses(bf16(tokens, positions), labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(
        loss, _lm_losses(fp32(tokens, positions), labels), rtol=0.02, atol=0.05
    )
    loss.sum().backward()
    assert bf16.decoder.layers["0"].mlp.linear_fc1.weight.grad.dtype == torch.bfloat16
