"""Fused kernels (models/fused.py): which parts Megatron's flags select, the clear word when a
requested kernel cannot run, and the wiring of Liger's functions into the model, checked on CPU
with emulations of their contracts (Liger has no CPU path; benchmarks/gpu compares the real
kernels with the PyTorch path on a GPU)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gigatron.config import GigatronConfig, parse_config
from gigatron.errors import GigatronError
from gigatron.families.gpt import make_forward_step
from gigatron.models import fused
from gigatron.models.fused import PYTORCH, liger_kernels, requested_fusions, select_kernels
from gigatron.models.gpt import build_model
from gigatron.parallel.context import ParallelContext

LLAMA_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
    "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--swiglu",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--padded-vocab-size", "128",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _rotate_half_hf(x, cos, sin):
    """Liger's RoPE contract: x [b, heads, s, d], tables [b, s, rd] (the first rd channels)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    out = rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return torch.cat([out, rest], dim=-1)


CALLS: list[str] = []


def _counted(name, function):
    def run(*args):
        CALLS.append(name)
        return function(*args)

    return run


# Plain-PyTorch functions with the argument order and layouts of Liger's autograd functions.
EMULATED = SimpleNamespace(
    rms_norm=_counted(
        "rms_norm",
        lambda x, w, eps, offset, mode, in_place: (
            (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            * (offset + w)
        ),
    ),
    rope=_counted(
        "rope", lambda q, k, cos, sin: (_rotate_half_hf(q, cos, sin), _rotate_half_hf(k, cos, sin))
    ),
    swiglu=_counted("swiglu", lambda y, in_place: F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1]),
    linear_cross_entropy=_counted(
        "linear_cross_entropy",
        lambda x, w, t, *rest: (F.cross_entropy(F.linear(x, w).float(), t, reduction="none"),),
    ),
)


def test_flags_select_the_parts_megatron_names():
    cfg = parse_config(LLAMA_FLAGS + ["--cross-entropy-loss-fusion"])
    assert requested_fusions(cfg.model) == {
        "rms_norm": "--transformer-impl transformer_engine",
        "rope": "--apply-rope-fusion",
        "swiglu": "--bias-swiglu-fusion",
        "linear_cross_entropy": "--cross-entropy-loss-fusion",
    }
    off = parse_config(
        LLAMA_FLAGS + ["--transformer-impl", "local", "--no-rope-fusion", "--no-bias-swiglu-fusion"]
    )
    assert requested_fusions(off.model) == {}
    # GPT-2's shape (LayerNorm, GeLU, learned positions) has nothing to fuse by default.
    assert requested_fusions(GigatronConfig().model) == {}
    clamped = parse_config(LLAMA_FLAGS + ["--activation-func-clamp-value", "7"])
    assert "swiglu" not in requested_fusions(clamped.model)


def test_cuda_with_the_library_selects_its_kernels():
    cfg = parse_config(LLAMA_FLAGS + ["--no-rope-fusion"])
    kernels = select_kernels(cfg.model, "cuda", 1, load=lambda: liger_kernels(EMULATED))
    assert kernels.active() == ["rms_norm", "swiglu"]


def test_cpu_runs_the_pytorch_path_and_names_an_explicit_request():
    cfg = parse_config(LLAMA_FLAGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # default-on fusions stay silent on a CPU
        assert select_kernels(cfg.model, "cpu", 1) is PYTORCH
    cfg = parse_config(LLAMA_FLAGS + ["--cross-entropy-loss-fusion"])
    with pytest.warns(UserWarning, match="--cross-entropy-loss-fusion: fused kernels need a CUDA"):
        assert select_kernels(cfg.model, "cpu", 1) is PYTORCH


def test_missing_library_and_tensor_parallel_loss_are_named():
    def missing():
        raise GigatronError("Liger-Kernel cannot be imported (no module); `pip install x`")

    cfg = parse_config(LLAMA_FLAGS + ["--cross-entropy-loss-fusion"])
    with pytest.warns(UserWarning, match=r"--apply-rope-fusion.*Liger-Kernel cannot be imported"):
        assert select_kernels(cfg.model, "cuda", 1, load=missing) is PYTORCH
    with pytest.warns(UserWarning, match="at tensor-parallel size 2 the vocab-parallel loss"):
        kernels = select_kernels(cfg.model, "cuda", 2, load=lambda: liger_kernels(EMULATED))
    assert kernels.linear_cross_entropy is None and kernels.rope is not None


def test_liger_import_error_says_how_to_install():
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(GigatronError, match=r"pip install 'gigatron\[gpu\]'"):
            fused.liger_ops()
    else:
        assert fused.liger_ops().rope is not None


def _losses_and_grads(cfg, monkeypatch, kernels):
    monkeypatch.setattr("gigatron.models.transformer_config.select_kernels", lambda *args: kernels)
    pctx = ParallelContext.single()
    (model,) = build_model(cfg, pctx)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, 16), generator=g)
    batch = {
        "tokens": tokens,
        "labels": tokens.roll(-1, 1),
        "loss_mask": (torch.rand(2, 16, generator=g) > 0.2).float(),
        "position_ids": torch.arange(16).expand(2, 16),
    }
    output, loss_fn = make_forward_step(cfg, pctx)(iter([batch]), model)
    loss_sum, tokens_count, _ = loss_fn(output)
    (loss_sum / tokens_count).backward()
    return loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_liger_wiring_computes_the_pytorch_model(monkeypatch):
    """Every part through the adapters to Liger's contracts (emulated) gives the PyTorch model's
    loss and gradients: the layouts, the weight, the partial rotary channels, the loss mask."""
    cfg = parse_config(LLAMA_FLAGS + ["--cross-entropy-loss-fusion", "--apply-layernorm-1p"])
    expected, expected_grads = _losses_and_grads(cfg, monkeypatch, PYTORCH)
    CALLS.clear()
    got, grads = _losses_and_grads(cfg, monkeypatch, liger_kernels(EMULATED))
    # 2 layers: 2 norms each plus the final norm, one RoPE and one SwiGLU each, one loss.
    assert sorted(set(CALLS)) == ["linear_cross_entropy", "rms_norm", "rope", "swiglu"]
    assert CALLS.count("rms_norm") == 5 and CALLS.count("rope") == 2
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert expected.item() > 0
    # The loss computed by the model equals the family's loss on the model's logits.
    plain = parse_config(LLAMA_FLAGS + ["--apply-layernorm-1p"])
    unfused, _ = _losses_and_grads(plain, monkeypatch, PYTORCH)
    torch.testing.assert_close(unfused, expected, rtol=1e-6, atol=1e-6)
