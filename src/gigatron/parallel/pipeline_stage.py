"""The contract between a model chunk and the schedules: `PipelineStage`.

Every model chunk handed to `parallel.schedules.forward_backward` is a `PipelineStage` (every
family's chunk subclasses it), possibly inside a `ChunkWrapper` (DDP, FSDP):
- `set_input_tensor(tensor_or_list)`: what the previous pipeline stage sent (one tensor, or a
  list when the run's messages are lists); the chunk's forward reads it (`stage_input(i)`)
  instead of embedding tokens.
- `aux_loss_modules()`: the modules whose auxiliary losses (MoE routers) get their backward
  gradient from the schedule (`AuxLossModule.set_aux_loss_scale`); by default every
  `AuxLossModule` inside the chunk.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

StageInput = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...] | None


class AuxLossModule(nn.Module):
    """A module with auxiliary losses that are not part of the loss the schedule calls backward
    on (MoE routers: see models/moe/aux_loss.py)."""

    def set_aux_loss_scale(self, value: torch.Tensor | float) -> None:
        """The gradient an auxiliary loss receives in backward (the main loss's multiplier)."""
        raise NotImplementedError(f"{type(self).__name__} must define set_aux_loss_scale")


class PipelineStage(nn.Module):
    """One model chunk as the schedules see it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_tensor: StageInput = None

    def set_input_tensor(self, input_tensor: StageInput) -> None:
        """What the previous pipeline stage sent: one tensor or a list of tensors, kept as
        given (used instead of the tokens by a chunk that does not embed)."""
        self.input_tensor = input_tensor

    def stage_input(self, index: int = 0) -> torch.Tensor:
        """Tensor `index` of what the previous stage sent (a single tensor is index 0)."""
        received = self.input_tensor
        if isinstance(received, (list, tuple)):
            received = received[index] if index < len(received) else None
        elif index > 0:
            received = None
        if received is None:
            raise RuntimeError(
                f"{type(self).__name__}: a pipeline chunk that does not embed needs "
                "set_input_tensor() first"
            )
        return received

    def aux_loss_modules(self) -> list[AuxLossModule]:
        """The modules of this chunk with auxiliary losses, in module order."""
        return [m for m in self.modules() if isinstance(m, AuxLossModule)]


class ChunkWrapper(nn.Module):
    """A wrapper of one model chunk (`.module`), transparent to attribute reads (`pre_process`,
    `set_input_tensor`, ...); `no_sync()` suspends its gradient reduction (none by default)."""

    module: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self._modules["module"], name)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def pipeline_stage(chunk: nn.Module) -> PipelineStage:
    """The `PipelineStage` of a model chunk, through its wrappers; a clear error otherwise."""
    target = chunk
    while isinstance(target, ChunkWrapper):
        target = target.module
    if not isinstance(target, PipelineStage):
        raise TypeError(
            f"model chunk {type(target).__name__} is not a PipelineStage: the schedules hand "
            "it the previous stage's output (set_input_tensor) and its auxiliary-loss modules "
            "their gradient (aux_loss_modules); derive it from "
            "gigatron.parallel.pipeline_stage.PipelineStage"
        )
    return target


def no_sync(chunk: nn.Module) -> contextlib.AbstractContextManager:
    """`chunk.no_sync()` for a wrapper that reduces gradients, else nothing."""
    return chunk.no_sync() if isinstance(chunk, ChunkWrapper) else contextlib.nullcontext()
