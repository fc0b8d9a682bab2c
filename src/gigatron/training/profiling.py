"""Run-time switches around the iterations: profiling (--profile, --record-memory-history),
garbage collection on a schedule (--manual-gc) and releasing cached memory
(--empty-unused-memory-level). The loop calls them; none changes what is computed."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from gigatron.errors import GigatronError


class StepProfiler:
    """torch.profiler over iterations `--profile-step-start` + 1 .. `--profile-step-end` (Megatron
    counts completed iterations: profiling starts when `start` are done and stops when `end`
    are) on the `--profile-ranks` (default rank 0). Traces go to `--tensorboard-dir` (TensorBoard's
    profiler plugin reads them) or `<--save or .>/profile`, one `rank<R>.*.pt.trace.json` per rank.
    On CUDA the same window is also marked with cudaProfilerStart/Stop, for `nsys --capture-range
    cudaProfilerApi`. `--record-memory-history` records CUDA allocations from the start and
    writes the snapshot to `--memory-snapshot-path` when the window ends."""

    def __init__(self, cfg: Any, rank: int, device: torch.device) -> None:
        log = cfg.logging
        self.enabled = log.profile and rank in (log.profile_ranks or [0])
        self.start_at, self.end_at = log.profile_step_start, log.profile_step_end
        if log.profile and self.end_at <= self.start_at:
            raise GigatronError(
                f"--profile-step-end {self.end_at} must be after --profile-step-start "
                f"{self.start_at}"
            )
        self.cuda = device.type == "cuda"
        self.directory = log.tensorboard_dir or os.path.join(cfg.checkpoint.save or ".", "profile")
        self.worker = f"rank{rank}"
        self.snapshot_path = log.memory_snapshot_path if log.record_memory_history else None
        self._profiler: Any = None
        if self.snapshot_path is not None:
            if not self.cuda:
                raise GigatronError(
                    "--record-memory-history: records CUDA allocations; this run is on "
                    f"{device.type} (drop the flag, or run on a GPU)"
                )
            torch.cuda.memory._record_memory_history(max_entries=100000)

    def before_iteration(self, completed: int) -> None:
        if self.enabled and completed == self.start_at and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.cudart().cudaProfilerStart()
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    self.directory, worker_name=self.worker
                ),
            )
            self._profiler.start()

    def after_iteration(self, completed: int) -> None:
        if completed == self.end_at:
            self.close()

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()  # writes the trace
            self._profiler = None
            if self.cuda:
                torch.cuda.cudart().cudaProfilerStop()
        if self.snapshot_path is not None:
            torch.cuda.memory._dump_snapshot(self.snapshot_path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_path = None


class ManualGC:
    """--manual-gc: Python's automatic collector is off for the run (its pauses then never land
    in the middle of a step on one rank while the others wait); a full collection runs every
    `--manual-gc-interval` iterations (0: never on a schedule) and around evaluations and
    saves. The collector's previous state is restored at the end."""

    def __init__(self, enabled: bool, interval: int) -> None:
        self.enabled = enabled
        self.interval = interval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> ManualGC:
        if self.enabled:
            gc.disable()
            gc.collect()
        return self

    def after_iteration(self, completed: int) -> None:
        if self.enabled and self.interval > 0 and completed % self.interval == 0:
            gc.collect()

    def collect(self) -> None:
        """Before and after evaluations and saves."""
        if self.enabled:
            gc.collect()

    def __exit__(self, *exc: Any) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()


def empty_unused_memory(level: int, at_level: int, device: torch.device) -> None:
    """--empty-unused-memory-level: return the caching allocator's unused blocks to the device
    (level 1: after each optimizer step; level 2: also after forward-backward). CPU tensors are
    freed to the system allocator at once: there is no cache to release there."""
    if level >= at_level and device.type == "cuda":
        torch.cuda.empty_cache()


def memory_scalars(device: torch.device) -> dict[str, float]:
    """Memory figures for --log-memory-to-tensorboard: the CUDA allocator's (allocated, reserved,
    peak, in bytes) on a GPU, the process's resident set size on a CPU."""
    if device.type == "cuda":
        return {
            "memory_allocated_bytes": float(torch.cuda.memory_allocated(device)),
            "memory_reserved_bytes": float(torch.cuda.memory_reserved(device)),
            "memory_max_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
        }
    # why: resource: Unix only
    import resource

    # ru_maxrss is in KiB on Linux.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"memory_max_rss_bytes": float(peak)}
