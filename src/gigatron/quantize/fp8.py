"""fp8 (e4m3) weights and inputs: each weight becomes an e4m3 value times its scale, one per
output row (`fp8-channel`) or per tensor (`fp8-tensor`), max |w| / 448 (448: e4m3's largest
finite value); each quantized layer's input gets one static scale, max |x| over the calibration
inputs / 448, applied at run time (models/activation_quant.py). The scheme compressed-tensors
calls float-quantized FP8 with static per-tensor activations.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gigatron.models.activation_quant import E4M3_MAX
from gigatron.quantize.folding import Calibrated
from gigatron.quantize.methods import Method


def quantize_fp8(weight: torch.Tensor, method: Method) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [..., out, in], float32 scales [..., out, 1] or [..., 1, 1]) of a 2-D weight
    or of grouped experts [experts, out, in] (each expert's own scales)."""
    values = weight.detach().to(torch.float32)
    dims = (-1,) if method.weight_scales == "channel" else (-2, -1)
    scales = values.abs().amax(dim=dims, keepdim=True) / E4M3_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (values / safe).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def fp8_calibrated(
    state: dict[str, torch.Tensor], input_max: dict[str, torch.Tensor], layers: Iterable[str],
    method: Method,
) -> Calibrated:  # fmt: skip
    """Every layer's e4m3 codes and scales, and its static input scale (`<layer>.input_scale`,
    [1]) from the largest calibration input; grouped experts: one input scale per expert
    ([experts]), each from the inputs routed to it (an expert no token reached: the largest of
    the others')."""
    result = Calibrated(layers={})
    for layer in layers:
        result.layers[layer] = quantize_fp8(state[f"{layer}.weight"], method)
        top = input_max[layer].to(torch.float32)
        if top.dim() == 2:  # grouped experts: [experts, in]
            top = top.amax(dim=-1)
            top = torch.where(top > 0, top, top.max())
        else:
            top = top.max().reshape(1)
        result.extra[f"{layer}.input_scale"] = (top / E4M3_MAX).clamp(min=1e-12)
    return result
