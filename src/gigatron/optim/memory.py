"""Bytes a rank holds for parameters, gradients and optimizer state, measured from the storages
of the tensors (not computed from counts), for the start-up metrics record and the memory
benchmark."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _add_storages(tensors: Iterable[torch.Tensor | None], seen: dict[tuple[str, int], int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        if hasattr(tensor, "to_local"):  # a DTensor (FSDP2): what this rank holds
            tensor = tensor.to_local()
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen[key] = nbytes = tensor.untyped_storage().nbytes()
        total += nbytes
    return total


def memory_bytes_per_rank(model_chunks: list[nn.Module], optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds, measured from the unique tensor storages (not computed):
    `params` (model parameters), `grads` (DDP gradient buffers, and fp32 gradient copies the
    optimizer holds), `optimizer_state` (fp32 main parameters and the inner optimizer's state),
    and `total`. A storage shared by several tensors is counted once, in the first category."""
    seen: dict[tuple[str, int], int] = {}
    model_params = [p for chunk in model_chunks for p in chunk.parameters()]
    params = _add_storages((p.detach() for p in model_params), seen)
    grads = _add_storages((getattr(p, "main_grad", None) for p in model_params), seen)
    grads += _add_storages((p.grad for p in model_params), seen)
    inner = getattr(optimizer, "optimizer", optimizer) if optimizer is not None else None
    main_params = [p for group in inner.param_groups for p in group["params"]] if inner else []
    grads += _add_storages((p.grad for p in main_params), seen)
    optimizer_state = _add_storages(main_params, seen)
    if inner is not None:
        optimizer_state += _add_storages(
            (value for per_param in inner.state.values() for value in per_param.values()), seen
        )
    return {
        "params": params,
        "grads": grads,
        "optimizer_state": optimizer_state,
        "total": params + grads + optimizer_state,
    }
