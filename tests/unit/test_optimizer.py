"""Optimizer: exact match with torch.optim, mixed precision, fp16 overflow, state round trip."""

import copy

import pytest
import torch
from torch import nn

from gigatron.config import GigatronConfig
from gigatron.optim import build_optimizer
from gigatron.optim.optimizer import FP32Optimizer, MixedPrecisionOptimizer, get_param_groups
from gigatron.parallel.context import ParallelContext

PCTX = ParallelContext.single()


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make_cfg(optimizer="adam", clip_grad=0.0, **training):
    cfg = GigatronConfig()
    cfg.optimizer.optimizer = optimizer
    cfg.optimizer.lr = 1e-2
    cfg.optimizer.weight_decay = 0.1
    cfg.optimizer.clip_grad = clip_grad
    for k, v in training.items():
        setattr(cfg.training, k, v)
    return cfg


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def loss_of(model, step):
    x, y = batch(step)
    out = model(x.to(next(model.parameters()).dtype))
    return ((out.float() - y) ** 2).mean()


def reference_groups(model, wd):
    decay = [model.fc1.weight, model.fc2.weight]
    no_decay = [model.fc1.bias, model.norm.weight, model.norm.bias, model.fc2.bias]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def test_param_groups_no_decay_on_biases_and_norms():
    model = TinyNet()
    decay, no_decay = get_param_groups([model])
    assert {id(p) for p in decay["params"]} == {id(model.fc1.weight), id(model.fc2.weight)}
    assert len(no_decay["params"]) == 4 and no_decay["wd_mult"] == 0.0


@pytest.mark.parametrize("use_main_grad", [False, True])
def test_fp32_adam_matches_torch_adamw(use_main_grad):
    """The fused AdamW gigatron uses equals torch's fused AdamW exactly, and torch's reference
    (for-loop) AdamW to within float rounding."""
    torch.manual_seed(0)
    model = TinyNet()
    fused_ref, loop_ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = build_optimizer(make_cfg(), [model], PCTX)
    assert isinstance(opt, FP32Optimizer)
    assert opt.optimizer.param_groups[0]["fused"]
    references = [
        (net, torch.optim.AdamW(reference_groups(net, 0.1), lr=1e-2, eps=1e-8, **kind))
        for net, kind in ((fused_ref, {"fused": True}), (loop_ref, {"foreach": False}))
    ]
    initial = [p.detach().clone() for p in model.parameters()]
    if use_main_grad:  # what DistributedDataParallel provides
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
    for step in range(4):
        opt.zero_grad()
        loss_of(model, step).backward()
        if use_main_grad:
            for p in model.parameters():
                p.main_grad.add_(p.grad)
                p.grad = None
        success, grad_norm, num_zeros = opt.step()
        assert success and num_zeros is None and grad_norm > 0
        for net, ref_opt in references:
            ref_opt.zero_grad()
            loss_of(net, step).backward()
            ref_opt.step()
    params = zip(model.parameters(), fused_ref.parameters(), loop_ref.parameters(), initial)
    for p, q, r, start in params:
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p, start)
    if use_main_grad:
        opt.zero_grad()
        assert all(torch.count_nonzero(p.main_grad) == 0 for p in model.parameters())


def test_sgd_momentum_matches_torch():
    torch.manual_seed(1)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt = build_optimizer(make_cfg("sgd"), [model], PCTX)
    ref_opt = torch.optim.SGD(reference_groups(ref, 0.1), lr=1e-2, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(ref, step).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_clipping_matches_torch_clip_grad_norm():
    torch.manual_seed(2)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt = build_optimizer(make_cfg(clip_grad=0.05), [model], PCTX)
    loss_of(model, 0).backward()
    loss_of(ref, 0).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    norm = opt.clip_grad_norm(0.05)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    assert norm > 0.05  # so clipping really happened
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    total = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters()))
    assert float(total) == pytest.approx(0.05, rel=1e-4)


def test_count_zeros():
    cfg = make_cfg()
    cfg.logging.log_num_zeros_in_grad = True
    model = TinyNet()
    opt = build_optimizer(cfg, [model], PCTX)
    loss_of(model, 0).backward()
    model.fc2.bias.grad[:3] = 0.0
    expected = sum(int((p.grad == 0).sum()) for p in model.parameters())
    assert expected >= 3
    _, _, num_zeros = opt.step()
    assert num_zeros == expected


def test_bf16_mixed_precision_tracks_fp32():
    torch.manual_seed(3)
    model32 = TinyNet()
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    opt32 = build_optimizer(make_cfg(clip_grad=1.0), [model32], PCTX)
    opt16 = build_optimizer(make_cfg(clip_grad=1.0, bf16=True), [model16], PCTX)
    assert isinstance(opt16, MixedPrecisionOptimizer)
    assert float(opt16.get_loss_scale()) == 1.0
    losses32, losses16 = [], []
    for step in range(30):
        for model, opt, losses in ((model32, opt32, losses32), (model16, opt16, losses16)):
            opt.zero_grad()
            loss = loss_of(model, step % 3)
            loss.backward()
            assert opt.step()[0]
            losses.append(loss.item())
    assert losses32[-1] < 0.6 * losses32[0]  # it really trained
    for a, b in zip(losses32, losses16):
        assert b == pytest.approx(a, rel=0.05, abs=0.02)
    # main params are fp32 and the bf16 model params are their rounded copies
    for model_param, main_param in opt16.param_pairs:
        assert model_param.dtype == torch.bfloat16 and main_param.dtype == torch.float32
        assert torch.equal(model_param, main_param.to(torch.bfloat16))
    main_of = {id(model_param): main for model_param, main in opt16.param_pairs}
    for p32, p16 in zip(model32.parameters(), model16.parameters()):
        torch.testing.assert_close(main_of[id(p16)], p32, rtol=0.05, atol=0.02)


def test_fp16_scales_loss_and_unscales_grads():
    torch.manual_seed(4)
    model32 = TinyNet()
    model16 = copy.deepcopy(model32).half()
    opt32 = build_optimizer(make_cfg(), [model32], PCTX)
    opt16 = build_optimizer(make_cfg(fp16=True, initial_loss_scale=1024.0), [model16], PCTX)
    assert float(opt16.get_loss_scale()) == 1024.0
    loss16 = loss_of(model16, 0)
    opt16.scale_loss(loss16).backward()
    loss_of(model32, 0).backward()
    success, norm16, _ = opt16.step()
    _, norm32, _ = opt32.step()
    assert success
    assert norm16 == pytest.approx(norm32, rel=2e-2)  # the norm of unscaled gradients


def test_fp16_overflow_skips_step_and_backs_off():
    torch.manual_seed(5)
    model = TinyNet().half()
    cfg = make_cfg(fp16=True, initial_loss_scale=2.0**16, hysteresis=2)
    opt = build_optimizer(cfg, [model], PCTX)
    before = [p.detach().clone() for p in model.parameters()]
    for expected_scale in (2.0**16, 2.0**15):
        opt.zero_grad()
        opt.scale_loss(loss_of(model, 0)).backward()
        model.fc1.weight.grad[0, 0] = float("inf")
        assert opt.step() == (False, None, None)
        assert float(opt.get_loss_scale()) == expected_scale
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.zero_grad()
    opt.scale_loss(loss_of(model, 0)).backward()
    success, norm, _ = opt.step()
    assert success and norm is not None
    assert not torch.equal(model.fc1.weight, before[0])


def test_mixed_precision_state_dict_round_trip():
    torch.manual_seed(6)
    model = TinyNet().to(torch.bfloat16)
    opt = build_optimizer(make_cfg(bf16=True), [model], PCTX)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    # torch's state_dict holds references to the live state: copy it, as a save/load would.
    state = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = build_optimizer(make_cfg(bf16=True), [model2], PCTX)
    opt2.load_state_dict(state)
    for (_, a), (_, b) in zip(opt.param_pairs, opt2.param_pairs):
        assert torch.equal(a, b)
    for model_, opt_ in ((model, opt), (model2, opt2)):
        opt_.zero_grad()
        loss_of(model_, 5).backward()
        opt_.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
