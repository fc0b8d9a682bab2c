"""Fake quantization of linear layers' inputs at run time (`gigatron quantize`'s W8A8 checkpoints,
docs/quantization.md), as compressed-tensors computes them (so gigatron's logits equal the
exported model's in transformers): int8 per token (`int8-smoothquant`), each token's input row
symmetric integer codes times one scale, max |x| / (2^(bits-1) - 1/2); or fp8 e4m3 with one
static scale per layer (`fp8-*`), x / scale clamped to +-448 and rounded to e4m3.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gigatron.errors import GigatronError

E4M3_MAX = 448.0  # e4m3's largest finite value


def fake_quantize_tokens(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x with each row (last dimension) rounded to `bits`-bit symmetric codes times its scale."""
    top = 2 ** (bits - 1)
    values = x.to(torch.float32)
    scale = values.abs().amax(dim=-1, keepdim=True) / (top - 0.5)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(values / safe).clamp(-top, top - 1) * safe).to(x.dtype)


def fake_quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 values times a static scale (a tensor: broadcast, e.g. per row)."""
    values = (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return (values.to(torch.float8_e4m3fn).to(torch.float32) * scale).to(x.dtype)


def quantize_linear_inputs(
    chunks: Iterable[nn.Module], layers: Iterable[str], bits: int, tensor_parallel: int,
    static_scales: dict[str, float] | None = None,
) -> int:  # fmt: skip
    """Fake-quantize the inputs of the named linear layers of `chunks`, per token, or fp8 with
    each layer's static scale in `static_scales`; returns how many layers. Per token, a
    row-parallel layer sees a slice of each token's features at tensor-parallel > 1 (its scale
    would differ), so that is refused."""
    if tensor_parallel > 1 and static_scales is None:
        raise GigatronError(
            f"--load: a checkpoint with {bits}-bit activations runs at tensor-parallel 1 here "
            f"(this run: {tensor_parallel}); convert it with gigatron convert-checkpoint "
            "--target-tensor-parallel-size 1"
        )
    wanted = set(layers)
    experts = {layer for layer in wanted if is_grouped_experts(layer)}
    if experts:
        _quantize_expert_inputs(chunks, experts, static_scales)
        wanted -= experts

    def hook(layer: str) -> Any:
        def quantize(_module: Any, inputs: tuple) -> tuple:
            if static_scales is not None:
                return (fake_quantize_fp8(inputs[0], static_scales[layer]), *inputs[1:])
            return (fake_quantize_tokens(inputs[0], bits), *inputs[1:])

        return quantize

    return _hook_modules(chunks, wanted, hook, "quantizes the inputs of layers")


def is_grouped_experts(layer: str) -> bool:
    """Whether a quantized layer is grouped experts' stacked weight ([experts, out, in])."""
    return re.fullmatch(r".*\.experts\.linear_fc[12]", layer) is not None


def expert_input_quantizer(fc1: torch.Tensor, fc2: torch.Tensor) -> Any:
    """GroupedExperts' `input_quantizer` for per-expert static fp8 scales of fc1's and fc2's
    inputs ([experts] each)."""
    scales = (fc1, fc2)

    def quantize(x: torch.Tensor, experts: Any, which: int) -> torch.Tensor:
        own = scales[which].to(x.device)
        if isinstance(experts, int):  # one expert's block
            return fake_quantize_fp8(x, own[experts])
        rows = own.repeat_interleave(experts.to(x.device), output_size=x.shape[0])
        return fake_quantize_fp8(x, rows[:, None])

    return quantize


def _quantize_expert_inputs(
    chunks: Iterable[nn.Module], layers: set[str], static_scales: dict[str, Any] | None
) -> None:
    """Each grouped experts module whose fc1 and fc2 have per-expert fp8 input scales."""
    if static_scales is None:
        raise GigatronError(
            f"--load: {min(layers)}: grouped experts take static fp8 input scales only; "
            "quantize them with int8-weight, int4-weight or fp8-*"
        )
    modules = {name: m for chunk in chunks for name, m in chunk.named_modules()}
    for name in sorted({layer.rsplit(".", 1)[0] for layer in layers}):
        module = modules.get(name)
        if module is None:
            continue  # another pipeline stage's
        fc1, fc2 = (
            torch.tensor(static_scales[f"{name}.{w}"]) for w in ("linear_fc1", "linear_fc2")
        )
        if len(fc1) != module.linear_fc1.weight.shape[0]:
            raise GigatronError(
                f"--load: {name}: {len(fc1)} experts' input scales for "
                f"{module.linear_fc1.weight.shape[0]} local experts; run at expert-parallel "
                "size 1"
            )
        module.input_quantizer = expert_input_quantizer(fc1, fc2)


def quantize_kv_cache(chunks: Iterable[nn.Module], scales: dict[str, list[float]]) -> int:
    """Round each attention's keys and values to e4m3 with its static scales (`scales`: the
    core attention module's name -> [key scale, value scale]) before the attention reads them,
    as an fp8 KV cache stores them; returns how many attentions."""

    def hook(name: str) -> Any:
        def quantize(_module: Any, inputs: tuple) -> tuple:
            q, k, v, *rest = inputs
            key, value = scales[name]
            return (q, fake_quantize_fp8(k, key), fake_quantize_fp8(v, value), *rest)

        return quantize

    return _hook_modules(chunks, set(scales), hook, "has fp8 KV-cache scales for attentions")


def _hook_modules(chunks: Iterable[nn.Module], names: set[str], hook: Any, what: str) -> int:
    """Register `hook(name)` before each named module of `chunks`; how many. Refused when the
    checkpoint names modules and none is in the model (pipeline stages hold some each)."""
    count = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name in names:
                module.register_forward_pre_hook(hook(name))
                count += 1
    if names and not count:
        raise GigatronError(
            f"--load: the checkpoint {what} (e.g. {min(names)}) that this model does not "
            "have; load it as it was saved"
        )
    return count
