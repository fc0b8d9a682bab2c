"""Dropout, with a mask that is cheaper to draw on CPU.

On CPU, `F.dropout` draws one Bernoulli sample per element, which costs several passes over the
tensor (about a tenth of a training step of a small GPT with attention dropout). Here a CPU mask
comes from 16-bit random lanes (four to each 64-bit draw of the generator) compared with a
threshold: an element is dropped with probability p' = round(p * 2^16) / 2^16 (within 2^-17 of
p) and the kept ones are scaled by 1 / (1 - p'), so the expected output is the input exactly.
The mask is a bool tensor, kept for the backward pass (as `F.dropout` does).

On CPU dropout is one operator (`gigatron::cpu_dropout`), eager and inside compiled layers alike:
inductor does not trace into it, so a compiled layer draws the same cheap mask from torch's
default generator instead of generating per-element random numbers in its loops, and dynamo's
activation checkpointing replays it from the saved generator state (the operator is tagged
nondeterministic_seeded). On a GPU it is `F.dropout` (its fused kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LANES = 1 << 16  # the values of one 16-bit lane


def uses_cheap_mask(x: Tensor, p: float, training: bool) -> bool:
    """Whether `dropout(x, p, training)` draws the CPU mask (CPU, training, 0 < p < 1)."""
    return training and 0 < p < 1 and x.device.type == "cpu"


def dropout_keep_scale(p: float) -> float:
    """1 / (1 - p'), the scale of the elements the CPU mask keeps (p < 1)."""
    return LANES / (LANES - round(p * LANES))


def keep_mask_into(out: Tensor, p: float) -> float:
    """Fill the bool tensor `out` with a mask keeping each element with probability 1 - p',
    drawn from torch's default CPU generator (so forked RNG streams and recomputation apply);
    the scale 1 / (1 - p')."""
    count = out.numel()
    words = torch.empty((count + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None)
    lanes = words.view(torch.int16)[:count].view(out.shape)  # uniform over [-2^15, 2^15)
    torch.ge(lanes, round(p * LANES) - LANES // 2, out=out)
    return dropout_keep_scale(p)


def keep_mask(shape: torch.Size, p: float) -> tuple[Tensor, float]:
    """(a bool mask keeping each element with probability 1 - p', the scale 1 / (1 - p'))."""
    mask = torch.empty(shape, dtype=torch.bool)
    return mask, keep_mask_into(mask, p)


@torch.library.custom_op(
    "gigatron::cpu_dropout",
    mutates_args=(),
    device_types="cpu",
    tags=(torch.Tag.nondeterministic_seeded,),
)
def cpu_dropout(x: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """(x with dropped elements zeroed and kept ones scaled, the keep mask)."""
    keep, scale = keep_mask(x.shape, p)
    return torch.where(keep, x, 0.0).mul_(scale), keep


@cpu_dropout.register_fake
def _(x, p):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])
    ctx.scale = dropout_keep_scale(inputs[1])


def _backward(ctx, grad, _grad_keep):
    (keep,) = ctx.saved_tensors
    return torch.where(keep, grad, 0.0) * ctx.scale, None


cpu_dropout.register_autograd(_backward, setup_context=_setup_context)


def dropout_unscaled(x: Tensor, p: float, training: bool = True) -> tuple[Tensor, float]:
    """(x with dropped elements zeroed, the scale the kept ones still need): the scale can go to
    a smaller tensor downstream (attention: the product with the values). Eager on CPU."""
    if not uses_cheap_mask(x, p, training) or torch.compiler.is_compiling():
        return F.dropout(x, p, training), 1.0
    keep, scale = keep_mask(x.shape, p)
    return torch.where(keep, x, 0.0), scale


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """`F.dropout(x, p, training)`; on CPU with the cheaper mask described above."""
    if not uses_cheap_mask(x, p, training):
        return F.dropout(x, p, training)
    return cpu_dropout(x, p)[0]
