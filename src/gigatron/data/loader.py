"""Micro-batches for each data-parallel rank, in Megatron's pretraining-sampler order.

Samples are taken in index order starting at `consumed_samples`; every block of
micro_batch_size x data-parallel-size consecutive samples is one micro-batch for all ranks, and
rank r takes the r-th slice of micro_batch_size. Resuming at `consumed_samples` therefore continues
exactly the stream an uninterrupted run would have read.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader

from gigatron.errors import GigatronError
from gigatron.faults import data_loader_worker_init, sigterm_blocked, worker_error_message


class PretrainingBatchSampler:
    """Index lists of this rank's micro-batches; incomplete last blocks are dropped."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if micro_batch_size <= 0:
            raise GigatronError(f"--micro-batch-size {micro_batch_size}: must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data-parallel rank {data_parallel_rank} outside size {data_parallel_size}"
            )
        if total_samples <= 0:
            raise GigatronError("the dataset holds no samples; check --data-path and --split")
        if consumed_samples >= total_samples:
            raise GigatronError(
                f"consumed samples {consumed_samples} >= the {total_samples} samples of the "
                "dataset: the run has read all its data; raise --train-samples/--train-iters "
                "only together with more data, or start from an earlier checkpoint"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        block = self.micro_batch_size * self.data_parallel_size
        return (self.total_samples - self.consumed_samples) // block

    def __iter__(self) -> Iterator[list[int]]:
        block = self.micro_batch_size * self.data_parallel_size
        first = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - block + 1, block):
            yield list(range(start + first, start + first + self.micro_batch_size))


_LINUX = sys.platform.startswith("linux")


class _Loader(DataLoader):
    """A DataLoader whose worker processes start with SIGTERM blocked in every thread, so that
    they can tell their main process's SIGTERM from torchrun's (faults.data_loader_worker_init)."""

    def __iter__(self) -> Iterator[Any]:
        with sigterm_blocked():  # the workers are forked here
            return super().__iter__()


def build_data_loader(
    dataset: Sized,
    micro_batch_size: int,
    consumed_samples: int,
    pctx: Any = None,
    num_workers: int = 0,
    data_parallel_size: int | None = None,
    data_parallel_rank: int | None = None,
) -> DataLoader:
    """A torch DataLoader over this rank's micro-batches (tensors stacked by default_collate).

    Worker processes ignore SIGTERM but their main process's (which handles it and stops them,
    also at exit) and die with the main process (see gigatron/faults.py).
    """
    dp_size = data_parallel_size if data_parallel_size is not None else _pctx(pctx, "dp_size")
    dp_rank = data_parallel_rank if data_parallel_rank is not None else _pctx(pctx, "dp_rank")
    sampler = PretrainingBatchSampler(
        len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size
    )
    return _Loader(
        dataset,  # type: ignore[arg-type]
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        # Linux: forked from this process whatever the default start method (forkserver from
        # Python 3.14), as a worker watches its parent's pid (data_loader_worker_init).
        multiprocessing_context="fork" if num_workers > 0 and _LINUX else None,
        worker_init_fn=(
            functools.partial(data_loader_worker_init, os.getpid()) if num_workers > 0 else None
        ),
    )


def _pctx(pctx: Any, name: str) -> int:
    if pctx is None:
        return 0 if name == "dp_rank" else 1
    return int(getattr(pctx, name))


def build_data_iterator(
    dataset: Sized | None, *loader_args: Any, cycle: bool = False, **loader_kwargs: Any
) -> Iterator[dict[str, torch.Tensor]] | None:
    """Iterator of this rank's micro-batches (dicts of stacked tensors); None without a dataset.
    `loader_args`, `loader_kwargs`: `build_data_loader`'s.

    `cycle=True` (validation) starts over at `consumed_samples` when the data runs out, like
    Megatron's cyclic iterator, so evaluation never stops for lack of samples.
    """
    if dataset is None:
        return None
    loader = build_data_loader(dataset, *loader_args, **loader_kwargs)
    if not cycle:
        # iter() now, not at the first batch: it draws the loader's seed from torch's generator,
        # and a later draw would change the random stream of the model (dropout).
        return _batches(iter(loader))
    if len(loader.batch_sampler) == 0:  # type: ignore[arg-type]
        raise GigatronError(
            f"the dataset has {len(dataset)} samples, fewer than one micro-batch across all "
            "data-parallel ranks; lower --micro-batch-size or give more data"
        )
    return _cycle(loader)


def _batches(batches: Iterator[Any]) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches; a GigatronError raised in a worker process (a data file truncated
    mid-run) keeps its one-line message instead of carrying the worker's traceback."""
    try:
        yield from batches
    except GigatronError as error:
        raise type(error)(worker_error_message(error)) from None


def _cycle(loader: DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from _batches(iter(loader))
