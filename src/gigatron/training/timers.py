"""Named wall-clock timers for the phases of an iteration (forward-backward, optimizer, ...)."""

from __future__ import annotations

import time

import torch


class Timer:
    """Accumulates the elapsed time of start()/stop() pairs."""

    def __init__(self, name: str, synchronize: bool = False) -> None:
        self.name = name
        self.synchronize = synchronize
        self._elapsed = 0.0
        self._started_at: float | None = None

    def _sync(self) -> None:
        # CUDA kernels run asynchronously: without a sync the timer measures the launch only.
        if self.synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()

    def start(self) -> None:
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name} was started twice")
        self._sync()
        self._started_at = time.perf_counter()

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name} was stopped before it was started")
        self._sync()
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (including a running interval); `reset` zeroes the sum."""
        total = self._elapsed
        if self._started_at is not None:
            now = time.perf_counter()
            total += now - self._started_at
            if reset:
                self._started_at = now
        if reset:
            self._elapsed = 0.0
        return total


class Timers:
    """A set of timers by name; `timers("forward-backward").start()`."""

    def __init__(self, synchronize: bool = False) -> None:
        self.synchronize = synchronize
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name, self.synchronize)
        return self._timers[name]

    def names(self) -> list[str]:
        return list(self._timers)

    def elapsed_ms(self, reset: bool = True) -> dict[str, float]:
        """Milliseconds of every timer, keyed by name."""
        return {name: 1000.0 * t.elapsed(reset=reset) for name, t in self._timers.items()}
