"""A line now and then while training is running but has not logged yet.

The first log line comes after `--log-interval` iterations, and the first iteration is the slowest
(allocations, warm-up): a big model on a small CPU can stay silent for minutes. Until the first
log line, a background thread says which iteration is running and for how long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# Seconds before the first notice, then between notices.
FIRST_NOTICE_S = 10.0
NOTICE_EVERY_S = 30.0


class SlowStartNotice:
    """Call `iteration_started(n)` before each iteration and `stop()` at the first log line."""

    def __init__(
        self,
        say: Callable[[str], None],
        first_after_s: float | None = None,
        every_s: float | None = None,
    ) -> None:
        self._say = say
        self._first_after_s = FIRST_NOTICE_S if first_after_s is None else first_after_s
        self._every_s = NOTICE_EVERY_S if every_s is None else every_s
        self._stopped = threading.Event()
        self._iteration = 0
        self._started_at: float | None = None
        self._thread: threading.Thread | None = None

    def iteration_started(self, iteration: int) -> None:
        self._iteration = iteration
        if self._thread is None and not self._stopped.is_set():
            self._started_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="slow-start-notice", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        wait = self._first_after_s
        while not self._stopped.wait(wait):
            elapsed = time.monotonic() - (self._started_at or time.monotonic())
            self._say(
                f" iteration {self._iteration} running... ({elapsed:.0f} s since training "
                "started; the first log line comes after --log-interval iterations)"
            )
            wait = self._every_s

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
