"""Muon (optim/muon.py) on one process: equal to torch.optim.Muon, the Newton-Schulz iteration
against the SVD's polar factor, the QKV split and per-expert batching, the parameter split
between Muon and AdamW, and the flags' rules."""

from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import validate_config
from gigatron.errors import GigatronError
from gigatron.optim.muon import (
    COEFFICIENTS,
    QKV_ATTRIBUTE,
    MatrixOrthogonalizer,
    Muon,
    MuonSettings,
    coefficient_schedule,
    newton_schulz,
    per_matrix,
    scale_factor,
)
from gigatron.optim.optimizer import get_param_groups
from gigatron.parallel.context import ParallelContext

SIMPLE5 = tuple(COEFFICIENTS["simple"] * 5)
ADAM = {"lr": 0.02, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": None}


def _muon(param: torch.Tensor, settings: MuonSettings) -> Muon:
    orthogonalize = per_matrix(MatrixOrthogonalizer(settings, ParallelContext.single()))
    groups = [{"params": [param], "muon": True, "weight_decay": 0.1}]
    return Muon(groups, settings, orthogonalize, ADAM)


@pytest.mark.parametrize("nesterov", [True, False])
def test_equal_to_torch_muon(monkeypatch, nesterov):
    """Momentum, Nesterov, decoupled weight decay and the shape scale are torch's exactly (the
    iteration swapped for ours in fp32 on both sides); with torch's own bf16 iteration the
    updates agree to bf16 rounding."""
    torch.manual_seed(0)
    start = torch.randn(24, 8)
    settings = MuonSettings(
        momentum=0.95, nesterov=nesterov, coefficients=SIMPLE5, bf16=False,
        matmul_precision="highest", scale_mode="shape_scaling",
    )  # fmt: skip
    grads = [torch.randn(24, 8) for _ in range(4)]

    def run(optimizer_for):
        param = start.clone().requires_grad_()
        optimizer = optimizer_for(param)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        return param.detach()

    def reference(param):
        return torch.optim.Muon(
            [param], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
            adjust_lr_fn="original",
        )  # fmt: skip

    ours = run(lambda p: _muon(p, settings))
    bf16_torch = run(reference)
    with monkeypatch.context() as patch:
        patch.setattr(
            torch_muon,
            "_zeropower_via_newtonschulz",
            lambda g, coefficients, steps, eps: newton_schulz(g, [coefficients] * steps, False),
        )
        fp32_torch = run(reference)
    # one fp32 rounding apart: torch scales lr, we scale the update
    torch.testing.assert_close(ours, fp32_torch, rtol=0, atol=1e-6)
    moved = (fp32_torch - start).abs().max()
    assert moved > 0.05
    assert (bf16_torch - fp32_torch).abs().max() < 0.03 * moved


def test_newton_schulz_approaches_the_polar_factor():
    torch.manual_seed(1)
    g = torch.randn(32, 12)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    # polar_express converges (singular values close to 1); quintic lands in about [0.7, 1.2]
    precise = newton_schulz(g, coefficient_schedule("polar_express", 8), False)
    torch.testing.assert_close(precise, polar, atol=0.05, rtol=0)
    sv = torch.linalg.svdvals(newton_schulz(g, coefficient_schedule("quintic", 5), False))
    assert 0.6 < float(sv.min()) and float(sv.max()) < 1.25
    # the transposed (tall) and wide orientations agree; bf16 steps stay close to fp32
    wide = newton_schulz(g.T.contiguous(), coefficient_schedule("quintic", 5), False)
    torch.testing.assert_close(wide.T, newton_schulz(g, coefficient_schedule("quintic", 5), False))
    bf16 = newton_schulz(g, coefficient_schedule("quintic", 5), True)
    assert (bf16 - newton_schulz(g, coefficient_schedule("quintic", 5), False)).abs().max() < 0.05


def test_scale_modes_and_coefficient_schedules():
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert scale_factor(16, 64, "shape_scaling") == 1.0
    assert scale_factor(64, 16, "shape_scaling") == 2.0
    assert len(coefficient_schedule("quintic", 10)) == 10
    assert coefficient_schedule("polar_express", 9)[-1] == COEFFICIENTS["polar_express"][-1]
    with pytest.raises(GigatronError, match="multiple of 5"):
        coefficient_schedule("quintic", 3)


def test_qkv_split_and_experts_are_orthogonalised_per_part():
    settings = MuonSettings(coefficients=SIMPLE5, bf16=False, matmul_precision="highest")
    orthogonalize = MatrixOrthogonalizer(settings, ParallelContext.single())
    torch.manual_seed(2)
    groups, split, cols = 2, (8, 4, 4), 16
    qkv = torch.nn.Parameter(torch.randn(groups * 16, cols))
    setattr(qkv, QKV_ATTRIBUTE, split)
    update = torch.randn(groups * 16, cols)
    got = orthogonalize(qkv, update).view(groups, 16, cols)
    parts = update.view(groups, 16, cols).split(list(split), dim=1)
    for index, part in enumerate(parts):
        whole = part.reshape(-1, cols)
        want = newton_schulz(whole, list(SIMPLE5), False) * scale_factor(*whole.shape, "spectral")
        offset = sum(split[:index])
        torch.testing.assert_close(got[:, offset : offset + split[index]].reshape(-1, cols), want)
    experts = torch.nn.Parameter(torch.randn(3, 8, 16))
    update = torch.randn(3, 8, 16)
    got = orthogonalize(experts, update)
    for e in range(3):
        want = newton_schulz(update[e], list(SIMPLE5), False) * 4.0  # sqrt(max(8, 16))
        torch.testing.assert_close(got[e], want)


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(10, 4)
    model.linear = torch.nn.Linear(4, 4)
    model.output_layer = torch.nn.Linear(4, 10, bias=False)
    groups = get_param_groups([model], muon=True)
    muon = [g for g in groups if g.get("muon")]
    assert len(muon) == 1 and muon[0]["params"] == [model.linear.weight]
    others = {id(p) for g in groups if not g.get("muon") for p in g["params"]}
    assert others == {id(model.embedding.weight), id(model.linear.bias),
                      id(model.output_layer.weight)}  # fmt: skip
    # AdamW steps the others through the shared groups and state; Muon the matrix
    torch.manual_seed(3)
    settings = MuonSettings(coefficients=SIMPLE5, bf16=False)
    orthogonalize = per_matrix(MatrixOrthogonalizer(settings, ParallelContext.single()))
    optimizer = Muon(groups, settings, orthogonalize, ADAM)
    bias = model.linear.bias.detach().clone().requires_grad_()
    reference_bias = torch.optim.AdamW([bias], **ADAM)
    model.linear.bias.grad = bias.grad = torch.ones(4)
    for p in (model.embedding.weight, model.linear.weight, model.output_layer.weight):
        p.grad = torch.randn_like(p)
    for group in groups:
        group["weight_decay"] = 0.0 if group["wd_mult"] == 0 else 0.1
    reference_bias.param_groups[0]["weight_decay"] = 0.0
    optimizer.step()
    reference_bias.step()
    torch.testing.assert_close(model.linear.bias, bias)
    state = optimizer.state_dict()
    assert {"exp_avg", "momentum_buffer"} <= {k for s in state["state"].values() for k in s}
    optimizer.load_state_dict(state)
    assert optimizer.adam.state is optimizer.state  # still linked after loading


def _config(**optimizer) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, 16
    m.max_position_embeddings = 16
    for key, value in optimizer.items():
        setattr(cfg.optimizer, key, value)
    return cfg


def test_muon_flag_rules():
    validate_config(_config(optimizer="muon"))
    with pytest.raises(GigatronError, match="--muon-num-ns-steps 3"):
        validate_config(_config(optimizer="muon", muon_num_ns_steps=3))
    with pytest.raises(GigatronError, match="Lion is not available"):
        validate_config(_config(optimizer="muon", muon_scalar_optimizer="lion"))
    with pytest.raises(GigatronError, match="SYRK"):
        validate_config(_config(optimizer="muon", muon_use_syrk=True))
