"""`--async-save`: torch_dist checkpoints written in the background while training goes on.

A save copies this rank's pieces of the model and optimizer to private CPU tensors (the only
time the training loop waits), writes the small files (config, schedule, random states), and
hands the DCP write to a background thread. That thread's collectives (DCP gathers the plans and
the write results) run on a Gloo group of their own, so they never interleave with training
collectives. This is what `torch.distributed.checkpoint.async_save` does with its thread
executor; it is driven directly here so that the staging copy is explicit and the same on every
torch version (async_save's staging and return type changed between 2.11 and 2.13).

A save is finished (the files' checksums recorded, rank 0 writes `metadata.json`, renames
`iter_N.tmp/` to `iter_N/`, updates the tracker file, then every rank passes a barrier) when the
loop polls after an iteration and the write is done on every rank (one all-reduce decides it for
all), at the next save, or at the end of training. A crash before that leaves the previous checkpoint as the
latest; the next save of that iteration removes the leftover `.tmp` directory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.checkpoint.dist_format import PendingSave, start_save
from gigatron.checkpoint.state import TrainingState
from gigatron.parallel.context import ParallelContext


class AsyncCheckpointSaver:
    """One background torch_dist save at a time (collective: every rank makes one and calls it
    with the same arguments as `save_checkpoint`)."""

    def __init__(
        self, pctx: ParallelContext, on_complete: Callable[[int], None] | None = None
    ) -> None:
        self.pctx = pctx
        self.on_complete = on_complete
        # A group used by nothing else, so the writer thread's collectives stay in order.
        self.group = dist.new_group(backend="gloo") if pctx.world_size > 1 else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gigatron-ckpt")
        self.pending: PendingSave | None = None
        self.blocked_s = 0.0  # time the caller spent inside save()

    def save(
        self,
        save_dir: str | Path,
        iteration: int,
        model_chunks: list[nn.Module],
        optimizer: Any,
        scheduler: Any,
        cfg: Any,
        extra: dict[str, Any] | None = None,
        rng_tracker: Any = None,
    ) -> None:
        """Finish the previous save, then start this one and return once its tensors are
        copied."""
        start = time.perf_counter()
        self.wait()
        state = TrainingState(
            model_chunks, optimizer, scheduler, rng_tracker, iteration, dict(extra or {})
        )
        self.pending = start_save(
            save_dir, state, self.pctx, cfg, run_write=self.executor.submit,
            process_group=self.group,
        )  # fmt: skip
        self.blocked_s += time.perf_counter() - start

    @property
    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def poll(self) -> None:
        """Finish the pending save once its write is done on every rank (collective: call it
        after each iteration on every rank; all ranks decide together, so none finishes, and
        none reads the tracker file, before rank 0 has published the checkpoint)."""
        if self.pending is not None and self._done_everywhere():
            self._finish()

    def _done_everywhere(self) -> bool:
        done = self.pending.done()
        if self.pctx.world_size == 1 or not dist.is_initialized():
            return done
        flag = torch.tensor([1.0 if done else 0.0], device=self.pctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # the default group: the writer has its own
        return bool(flag.item() > 0)

    def wait(self) -> None:
        """Block until the pending save (if any) is written and published."""
        if self.pending is not None:
            self._finish()

    def _finish(self) -> None:
        pending, self.pending = self.pending, None
        pending.finish()
        if self.on_complete is not None:
            self.on_complete(pending.iteration)

    def close(self) -> None:
        """Finish the pending save and stop the writer thread (end of training)."""
        self.wait()
        self.executor.shutdown(wait=True)

    def abandon(self) -> None:
        """After an error: leave a pending save unpublished (its `.tmp` stays) and do not wait."""
        self.pending = None
        self.executor.shutdown(wait=False)
