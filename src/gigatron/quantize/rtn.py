"""Weight-only round-to-nearest quantization: symmetric integer codes with one scale per group of
`group_size` consecutive input features of each output row.

scale = max |w| of the group / (2^(bits-1) - 1) (127 for int8, 7 for int4), code =
round-half-even(w / scale) clamped to [-2^(bits-1), 2^(bits-1) - 1]; |w - code x scale| <= scale/2.
The largest |w| lands exactly on a code (+-127, +-7), so quantizing the dequantized weight again
gives back the same codes and scales.
"""

from __future__ import annotations

import math
import re

import torch

from gigatron.errors import GigatronError
from gigatron.quantize.methods import Method

# The linear layers of a decoder layer: `linear_*` weights (attention, MLA projections, MLP, MoE
# experts: grouped [experts, out, in] or one per expert) and a Mamba mixer's in_proj / out_proj.
_LINEAR = re.compile(
    r"(.*\.layers\.\d+\..*\b(?:linear_[a-z0-9_]+|mixer\.in_proj|mixer\.out_proj))\.weight"
)
_MAMBA = re.compile(r".*\.mixer\.(?:in_proj|out_proj)")


def quantized_layer(name: str) -> str | None:
    """The linear layer whose weight `name` is (None: not quantized: embeddings, norms, biases,
    the output layer stay in their precision)."""
    match = _LINEAR.fullmatch(name)
    return match.group(1) if match else None


def is_mamba_projection(layer: str) -> bool:
    """Whether a quantized layer is a Mamba mixer's in_proj or out_proj."""
    return _MAMBA.fullmatch(layer) is not None


def check_shape(
    layer: str, shape: tuple[int, ...], group_size: int, method: Method, calibrating: bool
) -> None:
    """Refuse, naming the layer, a weight the method (or a calibration) cannot take."""
    if len(shape) not in (2, 3) or (method.calibration not in (None, "fp8") and len(shape) == 3):
        raise GigatronError(
            f"{layer}: a weight of shape {tuple(shape)}; --method {method.name} quantizes 2-D "
            "linear weights (grouped [experts, out, in] expert weights by int8-weight or "
            "int4-weight: GPTQ per expert with --calib-data, else round-to-nearest; or fp8-*)"
        )
    if calibrating and method.calibration and is_mamba_projection(layer):
        raise GigatronError(
            f"{layer}: a Mamba mixer projection; --method {method.name} needs input scales "
            "folded into (or inputs quantized before) the layer, not supported for Mamba "
            "mixers; use int8-weight or int4-weight (GPTQ or round-to-nearest)"
        )
    if shape[-1] % group_size:
        raise GigatronError(
            f"{layer}: {shape[-1]} input features are not divisible by --group-size "
            f"{group_size}; give a group size that divides every linear layer's input size"
        )


def quantize_weight(
    weight: torch.Tensor, method: Method, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [..., out, in], scales float32 [..., out, in / group_size]) of a weight
    (2-D, or 3-D grouped experts: each expert's rows as a 2-D weight's)."""
    *lead, cols = weight.shape
    rows = math.prod(lead)
    groups = weight.detach().to(torch.float32).reshape(rows, cols // group_size, group_size)
    low, high = method.code_range
    scales = groups.abs().amax(dim=-1) / high
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(groups / safe[..., None]).clamp(low, high).to(torch.int8)
    return codes.reshape(*lead, cols), scales.reshape(*lead, cols // group_size)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales, each scale repeated over its group (a per-tensor scale [..., 1, 1] over
    its tensor's rows too), in `dtype`."""
    *lead, cols = codes.shape
    groups = scales.shape[-1]
    scales = scales.expand(*lead, groups)
    values = codes.to(torch.float32).reshape(*lead, groups, cols // groups) * scales[..., None]
    return values.reshape(*lead, cols).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte (even column in the low nibble): half the bytes of int8."""
    nibbles = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    if nibbles.shape[-1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The int8 codes `pack_int4` packed (sign-extended from 4 bits)."""
    low = (packed & 0xF).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    nibbles = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)[..., :cols]
    return torch.where(nibbles > 7, nibbles - 16, nibbles).to(torch.int8)
