"""The MLP activation chosen by the model options, shared by dense MLPs and MoE experts.

Gated MLPs (`--swiglu`, `--geglu` (T5 v1.1), `--quick-geglu`) compute fc1 = [gate; up] and return
act(gate) * (up + `--glu-linear-offset`), with the gate clamped to <= v and the linear half to
[-v, v] under `--activation-func-clamp-value v` (gpt-oss: quick GeLU, offset 1, clamp 7).
Ungated MLPs apply GeLU (tanh approximation with `--openai-gelu`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def _glu(h: torch.Tensor, act: Activation, offset: float, clamp: float | None) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    if offset:
        up = up + offset
    return act(gate) * up


def mlp_activation(config) -> Activation:
    """`h [..., fc1_out] -> [..., ffn]` for a config with `swiglu`, `geglu`, `quick_geglu`, `openai_gelu`,
    `glu_linear_offset` and `activation_func_clamp_value` (a TransformerConfig)."""
    offset = getattr(config, "glu_linear_offset", 0.0)
    clamp = getattr(config, "activation_func_clamp_value", None)
    if getattr(config, "quick_geglu", False):
        return partial(_glu, act=quick_gelu, offset=offset, clamp=clamp)
    gelu = partial(F.gelu, approximate="tanh" if config.openai_gelu else "none")
    if config.swiglu:
        kernels = getattr(config, "kernels", None)  # the fused kernel (models/fused.py)
        if kernels is not None and kernels.swiglu is not None and not offset and clamp is None:
            return kernels.swiglu
        return partial(_glu, act=F.silu, offset=offset, clamp=clamp)
    if getattr(config, "geglu", False):
        return partial(_glu, act=gelu, offset=offset, clamp=clamp)
    return gelu
