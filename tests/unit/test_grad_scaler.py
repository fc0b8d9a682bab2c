"""Loss scalers: overflow back-off after hysteresis, growth after the window."""

import pytest
import torch

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.optim.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    build_grad_scaler,
)


def scale(s):
    return float(s.scale.item())


def test_dynamic_backoff_after_hysteresis_and_min():
    s = DynamicGradScaler(8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert scale(s) == 8.0  # first overflow is tolerated
    s.update(True)
    assert scale(s) == 4.0
    s.update(True)
    assert scale(s) == 2.0  # hysteresis stays spent until a growth
    s.update(True)
    s.update(True)
    assert scale(s) == 1.0  # clamped at min_scale
    assert float(s.inv_scale.item()) == 1.0


def test_dynamic_growth_after_window_restores_hysteresis():
    s = DynamicGradScaler(8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    s.update(True)
    assert scale(s) == 4.0
    s.update(False)
    s.update(False)
    assert scale(s) == 4.0
    s.update(False)
    assert scale(s) == 8.0
    s.update(True)
    assert scale(s) == 8.0  # hysteresis budget is back to 2
    s.update(False)  # an overflow resets the growth window
    s.update(False)
    assert scale(s) == 8.0
    s.update(False)
    assert scale(s) == 16.0
    assert float(s.inv_scale.item()) == 1 / 16


def test_state_dict_round_trip():
    s = DynamicGradScaler(2.0**16, min_scale=1.0, growth_interval=5, hysteresis=3)
    s.update(True)
    s.update(False)
    t = DynamicGradScaler(1.0, min_scale=1.0, growth_interval=5, hysteresis=3)
    t.load_state_dict(s.state_dict())
    assert scale(t) == 2.0**16
    for found_inf in (False, False, False, False):
        s.update(found_inf)
        t.update(found_inf)
    assert scale(t) == scale(s) == 2.0**17


def test_constant_never_moves():
    s = ConstantGradScaler(128.0)
    s.update(True)
    s.update(False)
    assert scale(s) == 128.0
    assert torch.equal(s.inv_scale, torch.tensor([1 / 128.0]))


def test_build_choices():
    cfg = GigatronConfig()
    assert build_grad_scaler(cfg) is None
    cfg.training.bf16 = True
    assert build_grad_scaler(cfg) is None
    cfg.training.loss_scale = 64.0
    assert isinstance(build_grad_scaler(cfg), ConstantGradScaler)
    cfg.training.bf16, cfg.training.fp16, cfg.training.loss_scale = False, True, None
    cfg.training.loss_scale_window = 7
    dyn = build_grad_scaler(cfg)
    assert isinstance(dyn, DynamicGradScaler)
    assert scale(dyn) == 2.0**32 and dyn.growth_interval == 7 and dyn.hysteresis == 2


def test_bad_values():
    with pytest.raises(GigatronError, match="min-loss-scale"):
        DynamicGradScaler(1.0, min_scale=2.0)
    with pytest.raises(GigatronError, match="hysteresis"):
        DynamicGradScaler(4.0, min_scale=1.0, hysteresis=0)
