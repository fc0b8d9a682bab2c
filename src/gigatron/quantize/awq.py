"""AWQ (Lin et al., 2023), activation-aware weight quantization: before round-to-nearest, each
input feature j of a linear weight is multiplied by s_j = mean|x_j|^alpha (the layer's mean
input magnitude on the calibration text, normalised to geometric mean 1), and the operation
producing that input is divided by s_j, so the full-precision model computes the same function
while the salient features (large inputs) get finer quantization steps. alpha is searched on a
grid of 20 values in [0, 1) for the lowest output error on the calibration inputs,
tr(E H E^T) with E = W - Q(W diag(s)) diag(s)^-1 and H = 2 X^T X / n; alpha = 0 is
round-to-nearest, so no layer's error is above it. Where 1/s goes: quantize/folding.py.
"""

from __future__ import annotations

from functools import partial

import torch

from gigatron.quantize.folding import Calibrated, fold_scales, folds, scaled_codes
from gigatron.quantize.methods import Method
from gigatron.quantize.rtn import dequantize, quantize_weight

GRID = 20  # alphas 0, 0.05, ..., 0.95 (AutoAWQ's grid)


def layer_error(weight: torch.Tensor, effective: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(E H E^T), E = weight - effective: the squared output error on the calibration inputs."""
    error = weight.to(torch.float64) - effective.to(torch.float64)
    return ((error @ hessian) * error).sum().item()


def search_scale(
    weight: torch.Tensor, hessian: torch.Tensor, mean_abs: torch.Tensor, method: Method,
    group_size: int,
) -> torch.Tensor:  # fmt: skip
    """The input scales s (float32) of the alpha with the lowest output error."""
    base = mean_abs.to(torch.float32).clamp(min=1e-4)
    weight = weight.detach().to(torch.float32)
    best, best_scale = None, torch.ones_like(base)
    for step in range(GRID):
        scale = base ** (step / GRID)
        scale = scale / (scale.max() * scale.min()).sqrt()
        codes, scales = quantize_weight(weight * scale, method, group_size)
        error = layer_error(weight, dequantize(codes, scales, torch.float32) / scale, hessian)
        if best is None or error < best:
            best, best_scale = error, scale
    return best_scale


def awq(
    state: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor],
    mean_abs: dict[str, torch.Tensor], method: Method, group_size: int, gated_exact: bool,
) -> Calibrated:  # fmt: skip
    """AWQ's codes and scales of every layer in `hessians`, the folded tensors, and each scaled
    layer's s (`<layer>.awq_scale`)."""
    plan = folds(state, gated_exact)
    scales = {
        layer: search_scale(state[f"{layer}.weight"], hessians[layer], mean_abs[layer], method,
                            group_size)
        for layer in plan
    }  # fmt: skip
    changed = fold_scales(state, plan, scales)
    quantize = partial(quantize_weight, method=method, group_size=group_size)
    return scaled_codes(changed, plan, scales, list(hessians), quantize, "awq_scale")
