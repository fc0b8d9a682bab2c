"""Moving a data-loader batch to the run's device (shared by every family's forward step)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from gigatron.parallel.context import ParallelContext
from gigatron.parallel.context_parallel import get_batch_on_this_cp_rank


def _to_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return value.to(device, non_blocking=True)


def get_batch(
    data_iterator: Iterator | None, pctx: ParallelContext, keys: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The next micro-batch's `keys` (those present) as tensors on this rank's device.

    Every rank reads the same micro-batch of its data-parallel slice (the loader is
    deterministic), so nothing needs to be broadcast over the tensor-parallel group.
    """
    if data_iterator is None:
        raise RuntimeError("get_batch needs a data iterator on every rank that runs forward")
    raw = next(data_iterator)
    batch = {key: _to_tensor(raw[key], pctx.device) for key in keys if key in raw}
    # Under context parallelism: this rank's chunks of every sequence.
    return get_batch_on_this_cp_rank(batch, pctx)
