"""Random streams of a model-parallel run, and activation recomputation.

Two streams per rank:
- the default torch generator, seeded identically on every tensor-parallel rank of a pipeline
  stage (`seed_everything`): dropout on tensors replicated over tp (hidden states without
  sequence parallelism) then agrees across tp ranks, as it must;
- the "model-parallel" stream of a `ModelParallelRNG`, seeded `seed + 2718 + tp_rank`: dropout on
  tensors split over tp (attention probabilities of this rank's heads, sequence-parallel slices)
  must differ across tp ranks, else every shard would drop the same pattern.
The model owns its tracker (`build_model` creates one per rank and shares it between chunks);
nothing is global. `recompute` re-runs a function in backward with the same random draws.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from gigatron.parallel.context import ParallelContext

MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class ModelParallelRNG:
    """A separate generator state swapped into the device's default generator by `fork()`.

    Swapping (rather than passing a torch.Generator to every op) keeps dropout calls plain
    `F.dropout`, which takes no generator argument.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seed = seed
        self._depth = 0
        # A model built on `meta` (shapes only, e.g. by the checkpoint converters) draws nothing.
        generator = torch.Generator(device="cpu" if self.device.type == "meta" else self.device)
        generator.manual_seed(seed)
        self._state = generator.get_state()

    @classmethod
    def for_rank(cls, seed: int, pctx: ParallelContext) -> ModelParallelRNG:
        """The tracker of this rank: seed + 2718 + tp_rank (+100 per pipeline stage, as the
        default stream)."""
        return cls(
            seed + 100 * pctx.pp_rank + MODEL_PARALLEL_SEED_OFFSET + pctx.tp_rank, pctx.device
        )

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw random numbers from the model-parallel stream inside the block (nests)."""
        if self._depth > 0:
            yield
            return
        outer = _get_device_state(self.device)
        _set_device_state(self.device, self._state)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._state = _get_device_state(self.device)
            _set_device_state(self.device, outer)

    def get_state(self) -> torch.Tensor:
        """The stream's state (checkpointed with the model, restored with `set_state`)."""
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()


def seed_everything(seed: int, pctx: ParallelContext) -> None:
    """Seed python, numpy and torch's default generators: the same on every tp (and dp) rank of a
    pipeline stage, different between stages (seed + 100 * pp_rank, as Megatron does)."""
    stage_seed = seed + 100 * pctx.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)


def recompute(fn: Callable[..., Any], *args: Any, rng: ModelParallelRNG | None = None) -> Any:
    """`fn(*args)` without keeping its activations: backward runs it again.

    torch.utils.checkpoint restores the default generators before the re-run; the model-parallel
    stream is restored here, so dropout draws the same masks both times.
    """
    if torch.compiler.is_compiling():
        # Inside a compiled layer (--torch-compile) nothing swaps the model-parallel stream in, so
        # the default generator, which the checkpoint replays, is the only one drawn from.
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    saved_state = rng.get_state() if rng is not None else None
    calls = 0

    def run(*inner_args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1 or rng is None:
            return fn(*inner_args)
        live_state = rng.get_state()
        rng.set_state(saved_state)
        try:
            return fn(*inner_args)
        finally:
            rng.set_state(live_state)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
