"""The Mamba-2 mixer: the chunked scan against the step-by-step recurrence (float64, forward and
backward), the convolution against its definition, the mixer and layer against Hugging Face
`Mamba2`, the tensor-parallel layout of the fused weights, the kernel calling convention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Block

from gigatron.config.root import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.models import mamba as mamba_module
from gigatron.models.mamba import MambaLayer, MambaSpec
from gigatron.models.ssd import (
    causal_depthwise_conv,
    segment_sum,
    ssd_chunked_scan,
    ssd_sequential_scan,
)
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import Grid, ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import (
    initialize_parameters,
    merge_partitions,
    slice_for_rank,
)


def _scan_inputs(length: int, batch=2, heads=4, head_dim=3, groups=2, state=5, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = randn(batch, length, heads, head_dim)
    dt = F.softplus(randn(batch, length, heads))
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 2 - 0.1
    B, C = randn(batch, length, groups, state), randn(batch, length, groups, state)
    D = randn(heads)
    initial = randn(batch, heads, head_dim, state)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D, initial)]


@pytest.mark.parametrize("length", [1, 13, 37])
@pytest.mark.parametrize("chunk", [1, 4, 8, 16, 64])
def test_chunked_scan_equals_recurrence_forward_and_backward(length, chunk):
    inputs = _scan_inputs(length)
    ref_y, ref_state = ssd_sequential_scan(*inputs, return_final_state=True)
    y, state = ssd_chunked_scan(*inputs[:5], chunk, *inputs[5:], return_final_state=True)
    assert y.dtype == torch.float64 and y.shape == ref_y.shape
    torch.testing.assert_close(y, ref_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)

    weights = torch.randn(*y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    state_weights = torch.randn(*state.shape, dtype=y.dtype)
    ref_grads = torch.autograd.grad(
        (ref_y * weights).sum() + (ref_state * state_weights).sum(), inputs
    )
    grads = torch.autograd.grad((y * weights).sum() + (state * state_weights).sum(), inputs)
    for name, grad, ref in zip("x dt A B C D initial".split(), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-9, msg=name)


def test_chunked_scan_without_initial_state_or_skip():
    x, dt, A, B, C, _, _ = _scan_inputs(10)
    y = ssd_chunked_scan(x, dt, A, B, C, 4)
    torch.testing.assert_close(y, ssd_sequential_scan(x, dt, A, B, C), rtol=1e-10, atol=1e-10)


def test_chunked_scan_in_float32_on_long_chunks_with_strong_decay():
    # 300 steps, chunk 128 (Megatron's), decays down to exp(-hundreds) inside a chunk: the
    # float32 result stays close to the float64 recurrence.
    x, dt, A, B, C, D, _ = (t.detach() for t in _scan_inputs(300, heads=2, groups=1))
    ref = ssd_sequential_scan(x, dt * 3, A, B, C, D)
    y = ssd_chunked_scan(*(t.float() for t in (x, dt * 3, A, B, C)), 128, D.float())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)


def test_segment_sum_by_hand():
    a = torch.tensor([1.0, 2.0, 4.0])
    inf = float("-inf")
    expected = torch.tensor([[0.0, inf, inf], [2.0, 0.0, inf], [6.0, 4.0, 0.0]])
    assert torch.equal(segment_sum(a), expected)


def test_causal_conv_is_the_windowed_sum():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 1, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    out = causal_depthwise_conv(x, weight, bias)
    padded = F.pad(x, (0, 0, 3, 0))  # three zero steps before the start
    for t in range(9):
        window = padded[:, t : t + 4]  # inputs t-3 .. t
        expected = F.silu((window * weight[:, 0].t()).sum(1) + bias)
        torch.testing.assert_close(out[:, t], expected, rtol=1e-12, atol=1e-12)


def _config(**model) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, 64, 4
    m.normalization, m.hidden_dropout = "RMSNorm", 0.0
    m.mamba_state_dim, m.mamba_head_dim, m.mamba_num_groups = 16, 16, 2
    for key, value in model.items():
        setattr(m, key, value)
    return cfg


def test_spec_follows_megatron_defaults_and_rules():
    cfg = GigatronConfig()
    cfg.model.hidden_size = 256
    spec = MambaSpec.from_config(cfg)
    # Megatron's defaults: state 128, head dim 64, 8 groups; heads = 2 * hidden / head dim.
    assert (spec.state_dim, spec.head_dim, spec.num_groups, spec.num_heads) == (128, 64, 8, 8)
    assert spec.d_inner == 512
    assert MambaSpec.from_config(_config(mamba_num_heads=6, mamba_num_groups=3)).d_inner == 96
    with pytest.raises(GigatronError, match="--mamba-num-groups 3: does not divide the 8"):
        MambaSpec.from_config(_config(mamba_num_groups=3))
    with pytest.raises(GigatronError, match="--mamba-head-dim 48"):
        MambaSpec.from_config(_config(mamba_head_dim=48))


def _hf_block(seed: int = 0) -> Mamba2Block:
    torch.manual_seed(seed)
    hf = Mamba2Config(
        hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=8
    )
    block = Mamba2Block(hf, 0)
    block.mixer.init_mamba2_weights()
    with torch.no_grad():
        for param in block.parameters():  # random everything, not just the initial values
            param.add_(torch.randn_like(param) * 0.2)
    return block


def _layer(cfg: GigatronConfig, pctx: ParallelContext | None = None) -> MambaLayer:
    pctx = pctx or ParallelContext.single()
    spec, mamba = TransformerConfig.from_config(cfg), MambaSpec.from_config(cfg)
    layer = MambaLayer(spec, mamba, pctx, 1, ModelParallelRNG(0))
    initialize_parameters(layer, 1234, pctx.tp_rank, pctx.tp_size)
    return layer


@pytest.mark.parametrize("length", [5, 21])
def test_layer_matches_hugging_face_mamba2_block(length):
    block = _hf_block()
    layer = _layer(_config())
    layer.load_state_dict(block.state_dict(), strict=True)  # same names, same layouts
    x = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(5))
    ref = block(x)
    out = layer(x.transpose(0, 1).contiguous()).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_mixer_result_does_not_depend_on_chunk_size():
    layer = _layer(_config())
    x = torch.randn(19, 2, 64, generator=torch.Generator().manual_seed(2))
    outputs = []
    for chunk in (1, 4, 128):
        layer.mixer.chunk_size = chunk
        outputs.append(layer(x))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[0], outputs[2], rtol=1e-5, atol=1e-5)


def test_initialisation_follows_megatron():
    mixer = _layer(_config(num_layers=4)).mixer
    A = -torch.exp(mixer.A_log.detach())
    assert ((-A >= 1.0) & (-A <= 16.0)).all()
    dt = F.softplus(mixer.dt_bias.detach())
    assert ((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5))).all()
    assert torch.equal(mixer.D.detach(), torch.ones(8))
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(128))
    assert mixer.conv1d.weight.abs().max() <= 0.5  # U(+-1/sqrt(4))
    assert abs(mixer.in_proj.weight.std().item() - 0.02) < 0.002
    # out_proj writes into the residual: std 0.02 / sqrt(2 * num_layers).
    assert abs(mixer.out_proj.weight.std().item() - 0.02 / 8**0.5) < 0.001


def test_in_proj_tp_slices_hold_whole_heads_and_groups():
    cfg = _config()
    full = _layer(cfg).mixer
    d_inner, bc, heads = 128, 2 * 16, 8
    blocks = full.in_proj.weight.detach().split([d_inner, d_inner, bc, bc, heads])
    for rank in range(2):
        part = _layer(cfg, ParallelContext(grid=Grid(tp=2), rank=rank)).mixer
        assert part.heads == 4 and part.groups == 1
        z, x, B, C, dt = part.in_proj.weight.detach().split([64, 64, 16, 16, 4])
        for got, block in zip((z, x, B, C, dt), blocks, strict=True):
            assert torch.equal(got, block.chunk(2)[rank])
        assert torch.equal(part.A_log.detach(), full.A_log.detach().chunk(2)[rank])
        conv = part.conv1d.weight.detach().split([64, 16, 16])
        full_conv = full.conv1d.weight.detach().split([d_inner, bc, bc])
        for got, block in zip(conv, full_conv, strict=True):
            assert torch.equal(got, block.chunk(2)[rank])


def test_block_strides_round_trip():
    full = torch.arange(2 * 6 + 4 + 2, dtype=torch.float32).unsqueeze(1)
    sizes = (6, 6, 4, 2)
    parts = [slice_for_rank(full, 0, sizes, r, 2) for r in range(2)]
    assert parts[0].squeeze(1).tolist() == [0, 1, 2, 6, 7, 8, 12, 13, 16]
    assert torch.equal(merge_partitions(parts, 0, sizes), full)


def test_tp_refuses_heads_or_groups_that_do_not_split():
    cfg = _config(mamba_num_groups=1)
    with pytest.raises(GigatronError, match="--mamba-num-groups 1 is not divisible by"):
        _layer(cfg, ParallelContext(grid=Grid(tp=2), rank=0))


def test_kernels_get_megatrons_calling_convention(monkeypatch):
    """With kernels present (faked here with their documented semantics: channels-first conv
    with a [c, w] weight; scan adding dt_bias and applying softplus itself), the mixer's output
    is the pure-PyTorch one."""
    calls = []

    def conv(x, weight, bias=None, activation=None):
        calls.append("conv")
        assert x.shape[1] == weight.shape[0] and weight.dim() == 2 and activation == "silu"
        return causal_depthwise_conv(x.transpose(1, 2), weight.unsqueeze(1), bias).transpose(1, 2)

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False):
        calls.append("scan")
        assert z is None and dt_softplus
        return ssd_sequential_scan(x, F.softplus(dt.float() + dt_bias), A, B, C, D).to(x.dtype)

    layer = _layer(_config())
    x = torch.randn(11, 2, 64, generator=torch.Generator().manual_seed(4))
    expected = layer(x)
    fake = {"conv": conv, "scan": scan}
    monkeypatch.setattr(mamba_module, "kernels_for", lambda tensor: fake)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    assert calls == ["conv", "scan"]


def test_mixer_runs_in_bf16():
    cfg = _config()
    cfg.training.bf16 = True
    layer = _layer(cfg)
    x = torch.randn(9, 2, 64).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in layer.parameters())
