"""Fused GPU kernels, chosen by Megatron's fusion flags (docs/performance.md).

The pure-PyTorch layers are the reference and the CPU default; on a CUDA device the flags pick
Liger-Kernel's Triton kernels (`pip install 'gigatron[gpu]'`) for the parts they name:

| part | flag (Megatron's) | kernel |
| RMSNorm | `--transformer-impl transformer_engine` (default; `local`: PyTorch) | LigerRMSNorm |
| RoPE | `--apply-rope-fusion` (default; `--no-rope-fusion`: PyTorch) | LigerRope |
| SwiGLU | `--bias-swiglu-fusion` (default; `--no-bias-swiglu-fusion`: PyTorch) | fused gate-up SiLU |
| loss | `--cross-entropy-loss-fusion` (tp 1) | fused linear cross entropy |

`select_kernels` returns a `Kernels` (None = the PyTorch path) and warns, once, when a part
was asked for but cannot run (no CUDA device, the library missing, tp > 1 for the loss). Each
kernel takes gigatron's layouts; `liger_kernels(ops)` adapts Liger's functions (`ops`, tests
give emulations of their contracts) to them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from gigatron.errors import GigatronError

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernels:
    """The fused kernels a model uses; None is the PyTorch path.

    `rms_norm(x [..., h], weight [h], eps) -> y`; `rope(q [s, b, np, d], k [s, b, ng, d], cos,
    sin [s, b, 1, rd]) -> (q, k)`; `swiglu(h [..., 2f] = [gate; up]) -> [..., f]`;
    `linear_cross_entropy(hidden [n, h], weight [v, h], labels [n]) -> losses [n]` (float32)."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor] | None = None
    rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    swiglu: Callable[[Tensor], Tensor] | None = None
    linear_cross_entropy: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def active(self) -> list[str]:
        """The names of the parts that run fused."""
        return [name for name, kernel in vars(self).items() if kernel is not None]


PYTORCH = Kernels()


def requested_fusions(model: Any) -> dict[str, str]:
    """{part: the flag asking for it} for a ModelConfig: the parts the model has whose fusion
    flag is on."""
    rotary = model.position_embedding_type in ("rope", "yarn") and not model.multi_latent_attention
    plain_swiglu = model.swiglu and not model.glu_linear_offset
    plain_swiglu = plain_swiglu and model.activation_func_clamp_value is None
    wanted = {
        "rms_norm": (
            model.normalization == "RMSNorm" and model.transformer_impl == "transformer_engine",
            "--transformer-impl transformer_engine",
        ),
        "rope": (rotary and model.apply_rope_fusion, "--apply-rope-fusion"),
        "swiglu": (plain_swiglu and model.bias_swiglu_fusion, "--bias-swiglu-fusion"),
        "linear_cross_entropy": (model.cross_entropy_loss_fusion, "--cross-entropy-loss-fusion"),
    }
    return {part: flag for part, (on, flag) in wanted.items() if on}


def select_kernels(
    model: Any, device_type: str, tp_size: int, load: Callable[[], Kernels] | None = None
) -> Kernels:
    """The kernels for a model (its ModelConfig) on `device_type` at tensor-parallel size
    `tp_size`; `load` gives the library's kernels (default `liger_kernels`)."""
    wanted = requested_fusions(model)
    if "linear_cross_entropy" in wanted and tp_size > 1:
        warnings.warn(
            "--cross-entropy-loss-fusion: the fused linear cross entropy needs the whole "
            f"vocabulary on one rank; at tensor-parallel size {tp_size} the vocab-parallel "
            "loss runs (one fp32 buffer of the logits' size)",
            stacklevel=2,
        )
        del wanted["linear_cross_entropy"]
    if not wanted:
        return PYTORCH
    if device_type != "cuda":
        # Megatron's defaults turn the RoPE and SwiGLU fusions on: only an explicit request
        # (the loss fusion is off by default) deserves a word on a CPU.
        if "linear_cross_entropy" in wanted:
            warnings.warn(
                f"--cross-entropy-loss-fusion: fused kernels need a CUDA device (this run is "
                f"on {device_type}); the PyTorch loss runs",
                stacklevel=2,
            )
        return PYTORCH
    try:
        kernels = (load or liger_kernels)()
    except GigatronError as error:
        warnings.warn(
            f"{', '.join(sorted(set(wanted.values())))}: {error}; the PyTorch path runs",
            stacklevel=2,
        )
        return PYTORCH
    return Kernels(**{part: getattr(kernels, part) for part in wanted})


def liger_ops() -> SimpleNamespace:
    """Liger-Kernel's autograd functions (a GigatronError when the package is missing)."""
    try:
        # why: an optional GPU dependency (Triton kernels), imported only when a CUDA run asks
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except ImportError as error:
        raise GigatronError(
            f"Liger-Kernel cannot be imported ({error}); `pip install 'gigatron[gpu]'`"
        ) from error
    return SimpleNamespace(
        rms_norm=LigerRMSNormFunction.apply,
        rope=LigerRopeFunction.apply,
        swiglu=LigerFusedGateUpSiLUMulFunction.apply,
        linear_cross_entropy=LigerFusedLinearCrossEntropyFunction.apply,
    )


def liger_kernels(ops: SimpleNamespace | None = None) -> Kernels:
    """Liger's kernels in gigatron's layouts; `ops` holds functions with the contracts of
    Liger's autograd functions (default: `liger_ops()`)."""
    ops = ops or liger_ops()

    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # "llama" casting: statistics in fp32, the normalised input cast back before the scale
        # (what `Norm` computes); not in place, the incoming gradient may be shared.
        flat = x.reshape(-1, x.shape[-1])
        return ops.rms_norm(flat, weight, eps, 0.0, "llama", False).view(x.shape)

    def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        # Liger takes [b, heads, s, d] (views of [s, b, heads, d] are fine: it transposes them
        # back to the storage order) and tables [b, s, rd] in the activations' dtype.
        tables = [t.squeeze(2).transpose(0, 1).to(q.dtype) for t in (cos, sin)]
        q_out, k_out = ops.rope(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), *tables)
        return q_out.permute(2, 0, 1, 3), k_out.permute(2, 0, 1, 3)

    def swiglu(h: Tensor) -> Tensor:
        return ops.swiglu(h, False)

    def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        losses = ops.linear_cross_entropy(
            hidden, weight, labels, None, None, -100, 0.0, 0.0, "none"
        )
        return (losses[0] if isinstance(losses, tuple) else losses).float()

    return Kernels(rms_norm, rope, swiglu, linear_cross_entropy)
