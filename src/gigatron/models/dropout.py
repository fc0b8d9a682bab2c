"""Dropout, with a mask that is cheaper to draw on CPU.

On CPU, `F.dropout` draws one Bernoulli sample per element, which costs several passes over the
tensor (about a tenth of a training step of a small GPT with attention dropout). Here a CPU mask
comes from 16-bit random lanes (four to each 64-bit draw of the generator) compared with a
threshold: an element is dropped with probability p' = round(p * 2^16) / 2^16 (within 2^-17 of
p) and the kept ones are scaled by 1 / (1 - p'), so the expected output is the input exactly.
The mask is a bool tensor, which autograd keeps for the backward pass (as `F.dropout` does).
Elsewhere (a GPU's fused kernel; inside a compiled graph, where inductor draws the mask in its
fused kernel) it is `F.dropout`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LANES = 1 << 16  # the values of one 16-bit lane


def uses_cheap_mask(x: torch.Tensor, p: float, training: bool) -> bool:
    """Whether `dropout(x, p, training)` draws the CPU mask (eager CPU, 0 < p < 1)."""
    return training and 0 < p < 1 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def keep_mask(shape: torch.Size, p: float) -> tuple[torch.Tensor, float]:
    """(a bool mask keeping each element with probability 1 - p', the scale 1 / (1 - p')), drawn
    from torch's default CPU generator (so forked RNG streams and recomputation apply)."""
    dropped = round(p * LANES)
    count = math.prod(shape)
    words = torch.empty((count + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None)
    lanes = words.view(torch.int16)[:count].view(shape)  # uniform over [-2^15, 2^15)
    return lanes >= dropped - LANES // 2, LANES / (LANES - dropped)


def dropout_unscaled(
    x: torch.Tensor, p: float, training: bool = True
) -> tuple[torch.Tensor, float]:
    """(x with dropped elements zeroed, the scale the kept ones still need): the scale can go to
    a smaller tensor downstream (attention: the product with the values)."""
    if not uses_cheap_mask(x, p, training):
        return F.dropout(x, p, training), 1.0
    keep, scale = keep_mask(x.shape, p)
    return torch.where(keep, x, 0.0), scale


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`F.dropout(x, p, training)`; on CPU (eager) with the cheaper mask described above."""
    y, scale = dropout_unscaled(x, p, training)
    return y if scale == 1.0 else y.mul_(scale)
