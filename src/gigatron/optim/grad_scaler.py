"""Loss scaling for fp16 training: a constant scale (`--loss-scale`) or a dynamic one.

The dynamic scaler (Megatron's semantics) halves the scale after `hysteresis` overflowing
iterations (never below `min_scale`) and doubles it after `growth_interval` iterations in a row
without overflow; a growth also restores the hysteresis budget.
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError


class GradScaler:
    """Base: holds `scale` (a float32 tensor) and `inv_scale`."""

    def __init__(self, initial_scale: float) -> None:
        if initial_scale <= 0:
            raise GigatronError(f"loss scale {initial_scale} must be positive")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = state["scale"].detach().to(torch.float32).reshape(1).clone()


class ConstantGradScaler(GradScaler):
    """`--loss-scale S`: the scale never changes; overflowing steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        pass


class DynamicGradScaler(GradScaler):
    """Grows after a window without overflow, backs off after `hysteresis` overflows."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        super().__init__(initial_scale)
        if min_scale <= 0 or min_scale > initial_scale:
            raise GigatronError(
                f"--min-loss-scale {min_scale} must be positive and at most "
                f"--initial-loss-scale {initial_scale}"
            )
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise GigatronError("loss-scale growth factor must be > 1 and backoff in (0, 1)")
        if growth_interval <= 0:
            raise GigatronError(f"--loss-scale-window {growth_interval} must be positive")
        if hysteresis <= 0:
            raise GigatronError(f"--hysteresis {hysteresis} must be positive")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.maximum(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(cfg: Any) -> GradScaler | None:
    """Megatron's choice: `--loss-scale` gives a constant scaler (fp16 or bf16); otherwise fp16
    gets a dynamic one and bf16/fp32 none."""
    t = cfg.training
    if not (t.fp16 or t.bf16):
        return None
    if t.loss_scale:
        return ConstantGradScaler(t.loss_scale)
    if t.fp16:
        return DynamicGradScaler(
            initial_scale=t.initial_loss_scale,
            min_scale=t.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=t.loss_scale_window,
            hysteresis=t.hysteresis,
        )
    return None
