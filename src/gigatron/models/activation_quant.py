"""Fake quantization of linear layers' inputs at run time (W8A8 checkpoints of `gigatron
quantize --method int8-smoothquant`, docs/quantization.md): each token's input row becomes
symmetric integer codes times one scale, max |x| / (2^(bits-1) - 1/2) (compressed-tensors'
dynamic per-token scheme, so gigatron's logits equal the exported model's in transformers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gigatron.errors import GigatronError


def fake_quantize_tokens(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x with each row (last dimension) rounded to `bits`-bit symmetric codes times its scale."""
    top = 2 ** (bits - 1)
    values = x.to(torch.float32)
    scale = values.abs().amax(dim=-1, keepdim=True) / (top - 0.5)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(values / safe).clamp(-top, top - 1) * safe).to(x.dtype)


def quantize_linear_inputs(
    chunks: Iterable[nn.Module], layers: Iterable[str], bits: int, tensor_parallel: int
) -> int:
    """Fake-quantize the inputs of the named linear layers of `chunks` per token; returns how
    many layers. A row-parallel layer sees a slice of each token's features at tensor-parallel
    > 1 (its scale would differ), so that is refused."""
    if tensor_parallel > 1:
        raise GigatronError(
            f"--load: a checkpoint with {bits}-bit activations runs at tensor-parallel 1 here "
            f"(this run: {tensor_parallel}); convert it with gigatron convert-checkpoint "
            "--target-tensor-parallel-size 1"
        )
    wanted, count = set(layers), 0

    def hook(_module: Any, inputs: tuple) -> tuple:
        return (fake_quantize_tokens(inputs[0], bits), *inputs[1:])

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name in wanted:
                module.register_forward_pre_hook(hook)
                count += 1
    if wanted and not count:
        raise GigatronError(
            f"--load: the checkpoint quantizes the inputs of {len(wanted)} layers (e.g. "
            f"{min(wanted)}) that this model does not have; load it as it was saved"
        )
    return count
