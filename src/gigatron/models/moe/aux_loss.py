"""How the auxiliary losses of MoE layers get their gradient.

An MoE layer's auxiliary losses (load balancing, z-loss) are not part of the loss the schedule
calls backward on: on a pipeline stage before the last, they are not even on the same process.
So each one is attached to a tensor of the layer's forward pass (the routing probabilities or
the router logits) with `attach_aux_loss`: the identity in forward, and in backward, when the
gradient of that tensor arrives, the auxiliary loss receives the gradient `scale` as if it had
been added to the main loss with weight 1.

`scale` must be what the schedule multiplies the main loss by before backward: the loss scale
(fp16) divided by the number of micro-batches (the main loss of each micro-batch is divided by
it), or just the loss scale under `--calculate-per-token-loss`, where the layer also multiplies
the auxiliary loss by its micro-batch's token count (the loop divides every gradient by the
global token count). Data-parallel averaging then applies to it as to the main loss. The
schedule sets it on the auxiliary-loss modules each stage names (`PipelineStage.aux_loss_modules`:
the routers) at the start of each forward-backward pass (`AuxLossScale` below), so nothing is
global.
"""

from __future__ import annotations

import torch


class AuxLossScale:
    """The gradient an auxiliary loss receives in backward (see the module docstring)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | float = 1.0

    def set(self, value: torch.Tensor | float) -> None:
        self.value = value.detach() if torch.is_tensor(value) else float(value)


class _InjectAuxLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier: torch.Tensor, aux_loss: torch.Tensor, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.scale
        if torch.is_tensor(scale):
            scale = scale.to(device=aux_loss.device, dtype=aux_loss.dtype).reshape(())
        return grad, torch.ones_like(aux_loss) * scale, None


def attach_aux_loss(
    carrier: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale
) -> torch.Tensor:
    """`carrier` unchanged; its backward also back-propagates `aux_loss` with gradient
    `scale.value`."""
    return _InjectAuxLossGradient.apply(carrier, aux_loss, scale.value)


def first_pass_weight(like: torch.Tensor) -> torch.Tensor:
    """1.0 (0-d, `like`'s device, float64) in a forward pass, 0.0 while autograd runs a backward
    pass (recomputing a checkpointed forward): routing statistics are multiplied by it so that a
    recomputation does not count them twice. An opaque operator, not a Python branch, so that a
    compiled layer (--torch-compile) asks at run time in its one graph; `like` ties it to the
    data, so the compiler neither folds it to a constant nor moves it out of its pass."""
    return _first_pass_weight(like.detach())


@torch.library.custom_op("gigatron::first_pass_weight", mutates_args=())
def _first_pass_weight(like: torch.Tensor) -> torch.Tensor:
    in_backward = torch._C._current_graph_task_id() != -1
    return torch.tensor(0.0 if in_backward else 1.0, dtype=torch.float64, device=like.device)


@_first_pass_weight.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=torch.float64, device=like.device)
