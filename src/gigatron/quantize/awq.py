"""AWQ (Lin et al., 2023), activation-aware weight quantization: before round-to-nearest, each
input feature j of a linear weight is multiplied by s_j = mean|x_j|^alpha (the layer's mean
input magnitude on the calibration text, normalised to geometric mean 1), and the operation
producing that input is divided by s_j, so the full-precision model computes the same function
while the salient features (large inputs) get finer quantization steps. alpha is searched on a
grid of 20 values in [0, 1) for the lowest output error on the calibration inputs,
tr(E H E^T) with E = W - Q(W diag(s)) diag(s)^-1 and H = 2 X^T X / n; alpha = 0 is
round-to-nearest, so no layer's error is above it.

Where 1/s goes (only where it is exact): `linear_qkv` into `input_layernorm`, a dense
`linear_fc1` into `pre_mlp_layernorm` (weight and bias), and `linear_fc2` of a gated MLP (SwiGLU:
act(gate) x up is linear in up) into the up half of `linear_fc1`'s rows. Other layers
(`linear_proj`, MoE experts, multi-latent attention) are quantized with s = 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from gigatron.errors import GigatronError
from gigatron.quantize.methods import Method
from gigatron.quantize.rtn import dequantize, quantize_weight

GRID = 20  # alphas 0, 0.05, ..., 0.95 (AutoAWQ's grid)
_SCALED = re.compile(
    r"(.*\.layers\.\d+)\.(self_attention\.linear_qkv|mlp\.linear_fc1|mlp\.linear_fc2)"
)


@dataclass(frozen=True)
class Fold:
    """Where a layer's 1/s goes: `tensors` (a weight and maybe its bias) divided by s along
    their first dimension, in `rows` of it (None: all)."""

    tensors: tuple[str, ...]
    rows: tuple[int, int] | None = None


@dataclass
class Calibrated:
    """What a calibration computed: (codes, scales) by layer, tensors it changed (by name), and
    extra tensors kept beside the codes (by name)."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def check_foldable(model_cfg) -> None:
    """Refuse a layer layout whose norms do not only feed the scaled layers."""
    flags = {"apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
             "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}  # fmt: skip
    for name, flag in flags.items():
        if getattr(model_cfg, name, False):
            raise GigatronError(
                f"{flag}: the model's norm outputs (or stored norm weights) "
                "cannot absorb AWQ's input scales; quantize it with int4-weight (GPTQ or "
                "round-to-nearest)"
            )


def folds(state: dict[str, torch.Tensor], gated_exact: bool) -> dict[str, Fold]:
    """The layers AWQ scales, each with where its 1/s goes (present in `state`)."""
    found = {}
    for name in state:
        match = (
            _SCALED.fullmatch(name.removesuffix(".weight")) if name.endswith(".weight") else None
        )
        if match is None:
            continue
        prefix, kind = match.groups()
        if kind == "mlp.linear_fc2":
            if not gated_exact:
                continue
            source, ffn = f"{prefix}.mlp.linear_fc1", state[name].shape[1]
            rows = (ffn, 2 * ffn)
        else:
            norm = "input_layernorm" if kind.startswith("self") else "pre_mlp_layernorm"
            source, rows = f"{prefix}.{norm}", None
        if f"{source}.weight" in state:
            tensors = tuple(f"{source}.{p}" for p in ("weight", "bias") if f"{source}.{p}" in state)
            found[name.removesuffix(".weight")] = Fold(tensors, rows)
    return found


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
    changed = {name: t.detach().to(torch.float32).clone() for name, t in state.items()}
    for layer, fold in plan.items():
        for name in fold.tensors:
            start, stop = fold.rows or (0, changed[name].shape[0])
            part = changed[name][start:stop]
            divisor = scales[layer] if part.dim() == 1 else scales[layer][:, None]
            changed[name][start:stop] = part / divisor
    result = Calibrated(layers={})
    for layer in hessians:
        weight = changed[f"{layer}.weight"]
        if layer in scales:
            weight = weight * scales[layer]
            result.extra[f"{layer}.awq_scale"] = scales[layer]
        result.layers[layer] = quantize_weight(weight, method, group_size)
    for fold in plan.values():
        for name in fold.tensors:
            if name.removesuffix(".weight") not in hessians:  # a quantized weight: its codes
                result.replaced[name] = changed[name]
    return result
