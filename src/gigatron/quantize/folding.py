"""Input scaling folded into the model (AWQ, SmoothQuant): a linear layer's weight is multiplied
by s along its input features and the operation producing its input divided by s, so the
full-precision model computes the same function. Only where that is exact: `linear_qkv`'s s into
`input_layernorm` (weight and bias), a dense `linear_fc1`'s into `pre_mlp_layernorm`, and a gated
MLP's (act(gate) x up is linear in up) `linear_fc2`'s into the up half of `linear_fc1`'s rows.
Other layers (`linear_proj`, MoE experts, multi-latent attention) keep s = 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from gigatron.errors import GigatronError

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
    """What a calibration computed: (codes, scales) by layer, tensors it changed (by name),
    extra tensors kept beside the codes (by name), and KV-cache scales (by core attention)."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_cache: dict[str, list[float]] = field(default_factory=dict)  # fp8 [key, value] scales


def check_foldable(model_cfg) -> None:
    """Refuse a layer layout whose norms do not only feed the scaled layers."""
    flags = {"apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
             "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}  # fmt: skip
    for name, flag in flags.items():
        if getattr(model_cfg, name, False):
            raise GigatronError(
                f"{flag}: the model's norm outputs (or stored norm weights) cannot absorb "
                "AWQ's or SmoothQuant's input scales; quantize it with int4-weight or "
                "int8-weight (GPTQ or round-to-nearest)"
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


def fold_scales(
    state: dict[str, torch.Tensor], plan: dict[str, Fold], scales: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state` in float32 with each layer's 1/s folded where `plan` says."""
    changed = {name: t.detach().to(torch.float32).clone() for name, t in state.items()}
    for layer, fold in plan.items():
        for name in fold.tensors:
            start, stop = fold.rows or (0, changed[name].shape[0])
            part = changed[name][start:stop]
            divisor = scales[layer] if part.dim() == 1 else scales[layer][:, None]
            changed[name][start:stop] = part / divisor
    return changed


def folded_tensors(
    changed: dict[str, torch.Tensor], plan: dict[str, Fold], quantized: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The folded tensors that are not quantized weights (norms, biases), by name."""
    return {
        name: changed[name]
        for fold in plan.values()
        for name in fold.tensors
        if name.removesuffix(".weight") not in quantized  # a quantized weight: its codes
    }


def scaled_codes(
    changed: dict[str, torch.Tensor], plan: dict[str, Fold], scales: dict[str, torch.Tensor],
    layers: Iterable[str], quantize: Callable[[torch.Tensor], tuple], name: str,
) -> Calibrated:  # fmt: skip
    """Each layer's (codes, scales) of its folded weight times its s (kept as `<layer>.<name>`),
    and the other folded tensors."""
    result = Calibrated(layers={})
    for layer in layers:
        weight = changed[f"{layer}.weight"]
        if layer in scales:
            weight = weight * scales[layer]
            result.extra[f"{layer}.{name}"] = scales[layer]
        result.layers[layer] = quantize(weight)
    result.replaced = folded_tensors(changed, plan, result.layers)
    return result
