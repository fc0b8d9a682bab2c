"""The precision-aware AdamW (`--use-precision-aware-optimizer`): Adam's moments stored in
`--exp-avg-dtype` / `--exp-avg-sq-dtype` (fp32, bf16, fp16), and with `--optimizer-cpu-offload`
the state of the first `--optimizer-offload-fraction` of the parameters (by element count, in
parameter-group order) kept on the host, where their step runs.

Each step upcasts a parameter's moments to fp32, runs AdamW's update in fp32 (torch's formula:
decoupled weight decay, bias corrections, eps outside the square root) and stores the moments
back in their dtype. An offloaded parameter's gradient is copied to the host (non-blocking from
pinned memory on a GPU), the update computed there with an fp32 copy of the parameter, and the
parameter copied back: the same arithmetic as on the device, so offloading changes where the
state lives and the step runs, not the numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HOST = torch.device("cpu")


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    group: dict[str, Any],
) -> None:
    """One AdamW update of fp32 tensors in place (torch.optim.AdamW's formula)."""
    beta1, beta2 = group["betas"]
    param.mul_(1 - group["lr"] * group["weight_decay"])
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = group["lr"] / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
    param.addcdiv_(exp_avg, denom, value=-step_size)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW with moments in chosen dtypes and an offloaded fraction (module docstring)."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        offload_fraction: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(param_groups, defaults)
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.offload_fraction = offload_fraction
        self._offloaded: tuple[tuple[int, ...], set[int]] | None = None

    @property
    def offloaded(self) -> set[int]:
        """ids of the parameters whose state is offloaded: the first ones, in group order, up
        to the fraction of all elements (chosen for the tensors held now: a mixed-precision
        wrapper swaps in its fp32 main copies after construction)."""
        params = [p for group in self.param_groups for p in group["params"]]
        key = tuple(id(p) for p in params)
        if self._offloaded is None or self._offloaded[0] != key:
            budget = self.offload_fraction * sum(p.numel() for p in params)
            chosen: set[int] = set()
            for param in params:
                if budget <= 0 and self.offload_fraction < 1.0:
                    break
                chosen.add(id(param))
                budget -= param.numel()
            self._offloaded = (key, chosen if self.offload_fraction > 0 else set())
        return self._offloaded[1]

    def state_device(self, param: torch.Tensor) -> torch.device:
        """Where `param`'s state lives and its step runs."""
        return HOST if id(param) in self.offloaded else param.device

    def _state(self, param: torch.Tensor, device: torch.device) -> dict[str, Any]:
        """`param`'s state on `device`, created or (after a checkpoint load, which gives fp32
        tensors where the parameter is) moved to its dtypes and device."""
        state = self.state[param]
        pin = device == HOST and param.device.type == "cuda"
        state.setdefault("step", torch.zeros((), dtype=torch.float32))
        for key, dtype in self.moment_dtypes.items():
            if key not in state:
                state[key] = torch.zeros(param.shape, dtype=dtype, device=device, pin_memory=pin)
            elif state[key].dtype != dtype or state[key].device != device:
                state[key] = state[key].to(device, dtype)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        offloaded = self.offloaded
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                device = HOST if id(param) in offloaded else param.device
                state = self._state(param, device)
                state["step"] += 1
                moments = [state[key].to(torch.float32) for key in ("exp_avg", "exp_avg_sq")]
                work = param if device == param.device and param.dtype == torch.float32 else None
                value = param.to(device, torch.float32, copy=True) if work is None else work
                grad = param.grad.to(device, torch.float32, non_blocking=True)
                adamw_update(value, grad, *moments, int(state["step"]), group)
                for key, moment in zip(("exp_avg", "exp_avg_sq"), moments):
                    if moment is not state[key]:
                        state[key].copy_(moment)
                if work is None:
                    param.copy_(value, non_blocking=True)
