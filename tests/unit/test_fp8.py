"""fp8 training through torchao's float8 (models/fp8.py), on CPU with torchao's emulation: the
flags, the module swap, the scaling against hand-computed fp8 rounding, the checkpoint round
trip and the refusal of shapes fp8 matrix products cannot take."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.models.fp8 import Float8Matmul, float8_config, fp8_layers
from gigatron.models.gpt import build_model
from gigatron.parallel.context import ParallelContext

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--padded-vocab-size", "128",
    "--swiglu", "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _round_trip(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, pow2=False):
    """t quantised to `dtype` with the scale max / amax (per tensor, or per slice along
    `dim`), and back: what an fp8 product sees of t."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double()).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).to(dtype).float() / scale


def _build(flags, seed_batch=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation's warning (tested below)
        (model,) = build_model(parse_config(TINY + flags), ParallelContext.single())
    return model


def _loss(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (2, 16), generator=g)
    logits = model(tokens, torch.arange(16).expand(2, 16))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 128).float(), tokens.flatten())


def test_flags():
    cfg = parse_config(TINY + ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"])
    assert (cfg.model.fp8, cfg.model.fp8_recipe) == ("hybrid", "rowwise")
    with pytest.raises(GigatronError, match="--fp8-recipe delayed: not available.*tensorwise"):
        parse_config(TINY + ["--fp8-format", "hybrid"])  # Megatron's default recipe
    with pytest.raises(GigatronError, match="--fp8-recipe rowwise needs --fp8-format"):
        parse_config(TINY + ["--fp8-recipe", "rowwise"])
    with pytest.raises(GigatronError, match="--fp8-amax-history-len 1024: an amax history"):
        parse_config(TINY + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                             "--fp8-amax-history-len", "1024"])  # fmt: skip


def test_module_swap_covers_the_transformer_linears_only():
    with pytest.warns(UserWarning, match="no CUDA device; torchao emulates"):
        (model,) = build_model(
            parse_config(TINY + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
            ParallelContext.single(),
        )
    swapped = {
        name
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("matmul"), Float8Matmul)
    }
    parts = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
             "mlp.linear_fc2")  # fmt: skip
    assert swapped == {f"decoder.layers.{i}.{p}" for i in (0, 1) for p in parts}
    assert set(fp8_layers(model)) == swapped  # not the output layer
    assert "matmul" not in model.output_layer.__dict__


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_tensorwise_scaling_matches_hand_computed_rounding(fp8_format):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    grad_out = torch.randn(32, 48, generator=g)
    matmul = Float8Matmul(float8_config(fp8_format, "tensorwise", emulate=True))
    y = matmul(x, w, None)
    y.backward(grad_out)
    xq, wq = _round_trip(x.detach(), E4M3), _round_trip(w.detach(), E4M3)
    torch.testing.assert_close(y.detach(), xq @ wq.t(), rtol=1e-5, atol=1e-4)
    gq = _round_trip(grad_out, E4M3 if fp8_format == "e4m3" else E5M2)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(w.grad, gq.t() @ xq, rtol=1e-5, atol=1e-4)
    exact = x.detach() @ w.detach().t()
    error = ((y.detach() - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 0.1  # fp8 rounding: visible, and small


def test_rowwise_scales_each_row_by_a_power_of_two():
    g = torch.Generator().manual_seed(2)
    # Rows of very different sizes: one scale per row keeps the small ones' precision.
    x = torch.randn(32, 64, generator=g) * torch.logspace(-3, 3, 32).unsqueeze(1)
    w = torch.randn(48, 64, generator=g)
    y = Float8Matmul(float8_config("e4m3", "rowwise", emulate=True))(x, w, None)
    expected = _round_trip(x, E4M3, dim=1, pow2=True) @ _round_trip(w, E4M3, dim=1, pow2=True).t()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    tensorwise = Float8Matmul(float8_config("e4m3", "tensorwise", emulate=True))(x, w, None)
    exact = x @ w.t()
    row_error = ((y - exact).norm(dim=1) / exact.norm(dim=1))[0].item()
    tensor_error = ((tensorwise - exact).norm(dim=1) / exact.norm(dim=1))[0].item()
    assert row_error < 0.1 < tensor_error  # the smallest row: kept, or lost to underflow


def test_training_with_fp8_is_close_to_the_reference_and_checkpoints_are_plain():
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"]
    reference, model = _build([]), _build(fp8)
    model.load_state_dict(reference.state_dict())
    expected, got = _loss(reference), _loss(model)
    assert got.item() != expected.item()
    assert math.isclose(got.item(), expected.item(), rel_tol=0.02)
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    assert state.keys() == reference.state_dict().keys()
    restored = _build(fp8)
    restored.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(_loss(restored, 5), _loss(model, 5), rtol=0, atol=0)


def test_shapes_not_divisible_by_16_are_refused_with_the_layer_named():
    fp8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    with pytest.raises(GigatronError, match=r"layer decoder\.layers\.0\.mlp\.linear_fc1 has a "
                       r"weight of 200 x 64 on this rank, not divisible by 16"):  # fmt: skip
        _build(fp8 + ["--ffn-hidden-size", "100"])
    with pytest.raises(GigatronError, match="a micro-batch holds 15 tokens per rank"):
        _build(fp8 + ["--seq-length", "15", "--micro-batch-size", "1"])
