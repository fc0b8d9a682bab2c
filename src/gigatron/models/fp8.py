"""fp8 training through torchao's float8 (`--fp8-format e4m3|hybrid`, `--fp8-recipe
tensorwise|rowwise`; docs/performance.md).

The module swap gives every tensor-parallel linear layer of the layer stacks (attention and MLP
projections, Mamba's, not the embedding or the output layer) an fp8 product: inputs and weights
are scaled to float8 e4m3 by their current amax (one scale per tensor, or per row with
`rowwise`), the gradient of the output to e4m3 (`e4m3`) or e5m2 (`hybrid`), and torch's scaled
matrix product runs them. Parameters stay plain tensors in their dtype, so checkpoints are the
same as without fp8. On a CPU, torchao emulates the fp8 product (the same rounding, no speed).
Expert weights of MoE layers (grouped GEMMs) stay in the parameter dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# torch's scaled matrix product needs both dimensions of each operand divisible by 16.
FP8_MULTIPLE = 16


def float8_config(fp8_format: str, recipe: str, emulate: bool) -> Any:
    """torchao's Float8LinearConfig for Megatron's format and a recipe (tensorwise, rowwise)."""
    torchao_float8, _ = _torchao_float8()
    base = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    grad_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else torch.float8_e5m2
    return dataclasses.replace(
        base,
        cast_config_grad_output=dataclasses.replace(
            base.cast_config_grad_output, target_dtype=grad_dtype
        ),
        cast_config_grad_output_for_grad_weight=dataclasses.replace(
            base.cast_config_grad_output_for_grad_weight, target_dtype=grad_dtype
        ),
        emulate=emulate,
    )


class Float8Matmul:
    """`(x, weight, bias) -> x W^T + b` with the product in fp8 (a parallel linear layer's
    `matmul`); the scales are computed in each call (dynamic scaling)."""

    def __init__(self, config: Any) -> None:
        torchao_float8, matmul = _torchao_float8()
        self.config = config
        gemm = torchao_float8.ScaledMMConfig(config.emulate, False, False, config.pad_inner_dim)
        self.mm_config = torchao_float8.LinearMMConfig(gemm, gemm, gemm)
        self.apply = matmul.apply

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = self.apply(flat, weight.t(), self.mm_config, self.config)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self) -> str:
        return f"Float8Matmul(emulate={self.config.emulate})"


def fp8_layers(chunk: nn.Module) -> dict[str, nn.Module]:
    """{name: layer} of the chunk's parallel linear layers that fp8 covers: those of its layer
    stacks (`...layers.N...`: attention, MLP, shared experts, Mamba and MTP layers), not the
    embedding or the output layer."""
    return {
        name: module
        for name, module in chunk.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        and ".layers." in f".{name}"
        and module.weight is not None
    }


def check_fp8_shapes(layers: dict[str, nn.Module], tokens: int | None) -> None:
    """A GigatronError naming the first layer whose weight (this rank's part) has a dimension
    not divisible by 16, or when the tokens of a micro-batch are not."""
    if tokens is not None and tokens % FP8_MULTIPLE:
        raise GigatronError(
            f"--fp8-format: a micro-batch holds {tokens} tokens per rank, not a multiple of "
            f"{FP8_MULTIPLE} (fp8 matrix products need it); change --micro-batch-size or "
            "--seq-length"
        )
    for name, layer in layers.items():
        out_features, in_features = layer.weight.shape
        if out_features % FP8_MULTIPLE or in_features % FP8_MULTIPLE:
            raise GigatronError(
                f"--fp8-format: layer {name} has a weight of {out_features} x {in_features} on "
                f"this rank, not divisible by {FP8_MULTIPLE} (fp8 matrix products need it); "
                "change the model shape or the tensor-parallel size, or drop --fp8-format"
            )


def apply_fp8(chunk: nn.Module, cfg: Any, device_type: str, tokens: int | None) -> int:
    """Give the chunk's transformer linear layers fp8 products when `--fp8-format` is set
    (emulated off CUDA); `tokens`: a micro-batch's tokens on this rank. Returns how many."""
    m = cfg.model
    if m.fp8 is None:
        return 0
    layers = fp8_layers(chunk)
    check_fp8_shapes(layers, tokens)
    emulate = device_type != "cuda"
    if emulate:
        warnings.warn(
            f"--fp8-format {m.fp8}: no CUDA device; torchao emulates the fp8 products "
            "(the same rounding, slower than without fp8)",
            stacklevel=2,
        )
    matmul = Float8Matmul(float8_config(m.fp8, m.fp8_recipe, emulate))
    for layer in layers.values():
        layer.matmul = matmul
    return len(layers)


def _torchao_float8() -> tuple[Any, Any]:
    """torchao.float8 and its fp8-or-high-precision matrix product (an autograd function)."""
    try:
        # why: torchao is an optional dependency (the `fp8` extra), needed only with --fp8-format
        with _quiet_loggers("torchao", "torch.utils._pytree"):
            import torchao.float8 as torchao_float8
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    except ImportError as error:
        raise GigatronError(
            f"--fp8-format: torchao cannot be imported ({error}); `pip install 'gigatron[fp8]'`"
        ) from error
    return torchao_float8, matmul_with_hp_or_float8_args


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """Only errors from these loggers meanwhile: torchao's import warns when its compiled
    kernels (not used by float8 training, which is PyTorch code and torch._scaled_mm) do not
    load on this machine, and about a deprecated registration; neither concerns the user."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
