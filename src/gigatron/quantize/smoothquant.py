"""SmoothQuant (Xiao et al., 2023), int8 weights and activations (W8A8): activation outliers are
migrated into the weights by input scales s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha) (alpha =
0.5; max|x_j| over the calibration inputs), folded into the model (quantize/folding.py); then
each weight row gets one int8 scale (max |row| / 127) and, at run time, each token's input row
one int8 scale (models/activation_quant.py), the scheme compressed-tensors calls int-quantized
W8A8 with dynamic per-token activations.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gigatron.quantize.folding import Calibrated, fold_scales, folds, scaled_codes
from gigatron.quantize.methods import Method
from gigatron.quantize.rtn import quantize_weight

ALPHA = 0.5  # the migration strength (the paper's choice for most models)
FLOOR = 1e-5  # keeps s finite for an input or a weight column that is all zeros


def smoothing_scales(weight: torch.Tensor, input_max: torch.Tensor) -> torch.Tensor:
    """s (float32, one per input feature) that balances the input and weight ranges."""
    weight_max = weight.detach().abs().amax(dim=0).to(torch.float32).clamp(min=FLOOR)
    scale = input_max.to(torch.float32).clamp(min=FLOOR) ** ALPHA / weight_max ** (1 - ALPHA)
    return scale.clamp(min=FLOOR)


def per_channel(weight: torch.Tensor, method: Method) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales [out, 1]) of a weight with one scale per output row."""
    return quantize_weight(weight, method, weight.shape[1])


def smoothquant(
    state: dict[str, torch.Tensor], input_max: dict[str, torch.Tensor], layers: Iterable[str],
    method: Method, gated_exact: bool,
) -> Calibrated:  # fmt: skip
    """The per-channel codes and scales of every layer in `layers` after smoothing, the folded
    tensors, and each smoothed layer's s (`<layer>.smooth_scale`)."""
    plan = folds(state, gated_exact)
    scales = {layer: smoothing_scales(state[f"{layer}.weight"], input_max[layer]) for layer in plan}
    changed = fold_scales(state, plan, scales)
    return scaled_codes(
        changed, plan, scales, layers, lambda w: per_channel(w, method), "smooth_scale"
    )
