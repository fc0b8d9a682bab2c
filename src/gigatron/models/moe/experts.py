"""The routed experts of one MoE layer on this rank: their MLP weights stacked, computed on the
dispatcher's token blocks (rows sorted by local expert).

Weights (names and layouts checkpoints and the Hugging Face maps rely on):
- `linear_fc1.weight` [local experts, fc1_out / etp, h], fc1_out = 2 x ffn ([gate; up], as the
  dense SwiGLU MLP) or ffn; split over expert tensor parallelism along dim 1 (stride 2 with
  SwiGLU);
- `linear_fc2.weight` [local experts, h, ffn / etp], split along dim 2.
Both are marked `expert_parallel = True` (the experts dimension is split over "ep", gradients are
reduced over "expert_dp") and carry the usual tensor-parallel attributes for etp.

Two ways to compute, with the same numbers: one grouped GEMM per weight
(`torch._grouped_mm`, where this torch build and device have it for the dtype and shapes), or a
loop over the experts' contiguous blocks (always available; the reference). A weight may hold
a LoRA adapter (models/lora.py; attribute `adapter`): its output is added to the weight's
product, computed with the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from gigatron.errors import GigatronError
from gigatron.models.activations import Activation, mlp_activation
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import recompute
from gigatron.parallel.tensor_parallel import set_tensor_parallel_attributes


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward
    rejects broadcast ones, such as the gradient of a sum)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here (probed on a tiny problem)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([2, 4], device=device, dtype=torch.int32)
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
            y.backward(torch.ones_like(y))
            return bool(torch.allclose(y.float(), torch.full_like(y.float(), 8.0)))
    except Exception:  # noqa: BLE001 - any failure means: not here
        return False


class GroupedExperts(nn.Module):
    """The local experts: `forward(x [N, h], tokens_per_expert [local]) -> [N, h]`."""

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        pctx: ParallelContext,
        *,
        swiglu: bool,
        openai_gelu: bool,
        init_std: float,
        output_init_std: float,
        params_dtype: torch.dtype,
        grouped_gemm: bool,
        activation: Activation | None = None,
        bias: bool = False,
        recompute_activation: bool = False,
    ) -> None:
        """`swiglu`: the MLP is gated (fc1 = [gate; up]); `activation` (default: SwiGLU or GeLU
        from `swiglu` and `openai_gelu`) is models/activations.py's choice for the model;
        `bias`: per-expert biases `linear_fc1.bias` [local experts, fc1_out],
        `linear_fc2.bias` [local experts, h] (Megatron's experts with `add_bias_linear`)."""
        super().__init__()
        etp = pctx.etp_size
        if bias and etp > 1:
            raise GigatronError(
                "MoE experts with biases (on without --disable-bias-linear) and expert tensor "
                f"parallel size {etp}: not supported; add --disable-bias-linear or use "
                "--expert-tensor-parallel-size 1"
            )
        local_ffn = ffn_hidden_size // etp
        self.swiglu = swiglu
        self.activation = activation or mlp_activation(
            SimpleNamespace(swiglu=swiglu, openai_gelu=openai_gelu)
        )
        fc1_out = local_ffn * (2 if swiglu else 1)
        shape1 = (num_local_experts, fc1_out, hidden_size)
        shape2 = (num_local_experts, hidden_size, local_ffn)
        device = pctx.device
        self.linear_fc1 = _Weight(torch.empty(shape1, dtype=params_dtype, device=device))
        self.linear_fc2 = _Weight(torch.empty(shape2, dtype=params_dtype, device=device))
        # Split over expert-tp (a group of one with etp = 1), like the dense MLP over tp.
        set_tensor_parallel_attributes(
            self.linear_fc1.weight, True, 1, 2 if swiglu else 1, "normal", init_std
        )
        set_tensor_parallel_attributes(
            self.linear_fc2.weight, True, 2, 1, "normal", output_init_std
        )
        if bias:
            self.linear_fc1.bias = nn.Parameter(
                torch.empty(shape1[:2], dtype=params_dtype, device=device)
            )
            self.linear_fc2.bias = nn.Parameter(
                torch.empty(shape2[:2], dtype=params_dtype, device=device)
            )
            set_tensor_parallel_attributes(
                self.linear_fc1.bias, True, 1, 2 if swiglu else 1, "zeros"
            )
            set_tensor_parallel_attributes(self.linear_fc2.bias, False, init="zeros")
        for param in self.parameters():
            param.expert_parallel = True
        # --recompute-modules moe_act: the activation's input is kept, its output recomputed.
        self.recompute_activation = recompute_activation
        self.use_grouped_gemm = grouped_gemm
        # Probed here, not in forward: a probe inside a checkpointed forward would save tensors
        # that its recomputation does not.
        self.grouped_gemm_used = grouped_gemm and self._grouped_gemm_available(device)
        # `input_quantizer(x, experts, which)`: fc1's (which 0) or fc2's (1) input rounded as a
        # quantized checkpoint's experts compute (models/activation_quant.py); `experts` is
        # tokens_per_expert (rows sorted by expert) or one expert's index. None: not quantized.
        self.input_quantizer: Callable[[torch.Tensor, Any, int], torch.Tensor] | None = None

    def _grouped_gemm_available(self, device: torch.device) -> bool:
        # `device`, not the weight's: weights built on meta (--init-model-with-meta-device) are
        # materialised there.
        w1 = self.linear_fc1.weight
        if device.type == "meta":
            return False
        # Strides must be multiples of 16 bytes.
        sizes = (w1.shape[1], w1.shape[2], self.linear_fc2.weight.shape[2])
        aligned = all(size * w1.element_size() % 16 == 0 for size in sizes)
        return aligned and grouped_mm_supported(device, w1.dtype)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.adapted():
            return self._forward_adapted(x, tokens_per_expert)
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        b1, b2 = self.linear_fc1.bias, self.linear_fc2.bias
        x = self._quantized(x, tokens_per_expert, 0)
        # guard_or_false: a data-dependent row count (capacity drops, compiled) takes the loop.
        if self.grouped_gemm_used and _grouped_mm_traceable(x) and guard_or_false(x.shape[0] > 0):
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            h = _ContiguousGrad.apply(torch._grouped_mm(x, w1.transpose(1, 2), offs=offsets))
            if b1 is not None:
                h = h + _rows_of_experts(b1, tokens_per_expert, x.shape[0])
            h = self._quantized(self._activate(h), tokens_per_expert, 1)
            y = _ContiguousGrad.apply(torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets))
            if b2 is not None:
                y = y + _rows_of_experts(b2, tokens_per_expert, x.shape[0])
            return y
        blocks = x.split(tokens_per_expert.tolist())
        outputs = [
            F.linear(
                self._quantized(
                    self._activate(F.linear(block, w1[e], None if b1 is None else b1[e])), e, 1
                ),
                w2[e],
                None if b2 is None else b2[e],
            )
            for e, block in enumerate(blocks)
        ]
        if not outputs:
            return x.new_zeros((0, w2.shape[1]))
        # Experts without tokens still join the graph, so their weights get zero gradients.
        return torch.cat(outputs)

    def adapted(self) -> bool:
        """Whether a weight holds an adapter (LoRA, models/lora.py: the attribute `adapter`, a
        module `(x [N, in], tokens_per_expert) -> [N, out]` whose output adds to the weight's)."""
        return any(getattr(w, "adapter", None) is not None for w in self._weights())

    def _weights(self) -> tuple[nn.Module, nn.Module]:
        return self.linear_fc1, self.linear_fc2

    def _forward_adapted(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The loop over the experts' blocks (the reference path), each weight's product plus
        its adapter's output."""
        counts = tokens_per_expert.tolist()
        for which, holder in enumerate(self._weights()):
            if holder is self.linear_fc2:
                x = self._activate(x)
            x = self._quantized(x, tokens_per_expert, which)
            w, b = holder.weight, holder.bias
            blocks = x.split(counts)
            y = torch.cat(
                [F.linear(blk, w[e], None if b is None else b[e]) for e, blk in enumerate(blocks)]
            )
            adapter = getattr(holder, "adapter", None)
            x = y if adapter is None else y + adapter(x, tokens_per_expert)
        return x

    def _quantized(self, x: torch.Tensor, experts: Any, which: int) -> torch.Tensor:
        return x if self.input_quantizer is None else self.input_quantizer(x, experts, which)

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if self.recompute_activation and self.training and torch.is_grad_enabled():
            return recompute(self.activation, h)
        return self.activation(h)


def _grouped_mm_traceable(x: torch.Tensor) -> bool:
    """torch.compile's shape rule for `_grouped_mm` takes bf16 only (the CPU kernel takes fp32
    too): other dtypes use the loop inside a compiled layer (--torch-compile)."""
    return x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()


def _rows_of_experts(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rows: int
) -> torch.Tensor:
    """Each row's expert's bias [rows, ...] (rows sorted by expert)."""
    return bias.repeat_interleave(tokens_per_expert.to(bias.device), dim=0, output_size=rows)


class _Weight(nn.Module):
    """Holds one stacked weight (and bias) so that names read `linear_fc1.weight` like the dense
    MLP's."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(data)
        self.bias: nn.Parameter | None = None
