"""Faults of multi-process runs, handled so that a user reads one clear line.

- One report per error: when every rank hits the same error (a bad flag, a missing file), the
  first rank to reach `report_error` prints it, writes it where torchrun's failure summary reads
  it, and exits with the error status; the ranks that hit the same error exit quietly with 0, so
  that torchrun names a single failure instead of one per process. The ranks agree through the
  run's key-value store (torchrun's, or torch.distributed's).
- A collective that times out (`--distributed-timeout-minutes`) or loses its peer becomes a
  `DistributedFault` naming the collective, the group and the ranks that did not answer.
- Data-loader workers ignore SIGTERM from anyone but their main process (torchrun sends it to
  each worker's whole process group; the main process saves a checkpoint with
  `--exit-signal-handler` and then stops its workers, also at exit) and die with their main
  process, quietly, instead of printing connection errors when it is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from gigatron.errors import GigatronError

STORE_TIMEOUT_S = 5.0
# How long the first reporting rank waits for the others to arrive (same error everywhere) before
# exiting: torchrun stops the workers still running as soon as one exits with an error, and
# processes reach the same point seconds apart on a loaded machine.
GATHER_WAIT_S = 15.0
# How long the ranks of a failed collective wait for each other to check in.
CHECK_IN_WAIT_S = 5.0
_KEY_PREFIX = "gigatron"


class DistributedFault(GigatronError):
    """A collective failed (timeout, lost peer): a fault of the run, not of the user's input."""

    exit_code = 1

    def __init__(self, message: str, report_key: str = "distributed-fault") -> None:
        super().__init__(message)
        # Ranks whose errors share this key are reported once.
        self.report_key = report_key


# ---- the run's key-value store ----------------------------------------------------------------
def run_store(timeout_s: float = STORE_TIMEOUT_S) -> Any | None:
    """A client of the store of this run (torchrun's agent store, or rank 0's under other
    launchers) with a short timeout; None outside a multi-process launch or when unreachable."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not address or not port:
        return None
    try:
        # why: torch loads only in commands that use it (gigatron --help stays fast)
        import torch.distributed as dist

        return dist.TCPStore(
            address,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception:  # noqa: BLE001 - no store to reach: the caller falls back to printing
        return None


def _run_key(name: str) -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_KEY_PREFIX}/{run}/{attempt}/{name}"


# ---- one report per error ---------------------------------------------------------------------
def _write_torchelastic_error(text: str) -> None:
    """Put the message where torchrun's failure summary shows it (instead of a link)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": text, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
    except OSError:
        pass  # the summary then shows torchrun's default line; the message is printed anyway


def report_error(
    command: str,
    message: str,
    exit_code: int = 2,
    report_key: str | None = None,
    stream: TextIO | None = None,
    exit_quietly: bool = False,
) -> int:
    """Print `gigatron <command>: error: <message>` once per run and return the exit status of
    this process (see the module docstring). With `exit_quietly`, a rank whose error was already
    reported ends at once (os._exit(0)): the first rank waits until the others are gone before
    it exits, since torchrun stops (and lists) every worker still running after one fails."""
    stream = stream or sys.stderr
    text = f"gigatron {command}: error: {message}"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        print(text, file=stream, flush=True)
        return exit_code
    rank = int(os.environ.get("RANK", "0"))
    key = report_key if report_key is not None else message
    store = run_store()
    if store is None:  # nobody to agree with: every rank speaks, labelled
        print(f"[rank {rank}] {text}", file=stream, flush=True)
        return exit_code
    try:
        arrival = store.add(_run_key("error-count"), 1)
        if arrival == 1:
            store.set(_run_key("error-key"), key)
            print(text, file=stream, flush=True)
            _write_torchelastic_error(text)
            # Every other rank either leaves quietly (same error) or reports its own.
            deadline = time.monotonic() + GATHER_WAIT_S
            while time.monotonic() < deadline:
                settled = store.add(_run_key("left"), 0) + store.add(_run_key("own-error"), 0)
                if settled >= world_size - 1:
                    time.sleep(0.3)  # the last ones are in os._exit: let the kernel finish
                    break
                time.sleep(0.05)
            return exit_code
        store.wait([_run_key("error-key")], datetime.timedelta(seconds=STORE_TIMEOUT_S))
        first_key = store.get(_run_key("error-key")).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the store went away: say it here rather than not at all
        print(f"[rank {rank}] {text}", file=stream, flush=True)
        return exit_code
    if first_key == key:  # already reported by the first rank: this rank leaves quietly
        _count(store, "left")
        if exit_quietly:
            # At once: an orderly interpreter shutdown can take seconds, and the first rank
            # exits (and torchrun stops whoever still runs) as soon as every rank has left.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    print(f"[rank {rank}] {text}", file=stream, flush=True)
    _write_torchelastic_error(f"[rank {rank}] {text}")
    _count(store, "own-error")
    return exit_code


def _count(store: Any, name: str) -> None:
    try:
        store.add(_run_key(name), 1)
    except Exception:  # noqa: BLE001 - only how long the first rank waits depends on it
        pass


# ---- collectives that fail ----------------------------------------------------------------------
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(
    r"connection (reset|closed) by peer|broken pipe|connection refused", re.IGNORECASE
)
_WAITED_MS = re.compile(r"waiting (\d+)\s*ms", re.IGNORECASE)


def is_distributed_failure(error: BaseException) -> bool:
    """A RuntimeError raised inside torch.distributed for a timeout or a lost peer."""
    if not isinstance(error, RuntimeError) or isinstance(error, GigatronError):
        return False
    text = str(error)
    if not (_TIMEOUT.search(text) or _PEER_LOST.search(text)):
        return False
    return _distributed_frame(error.__traceback__) is not None or "gloo" in text.lower()


def _distributed_frame(tb: types.TracebackType | None) -> types.FrameType | None:
    """The innermost frame of a torch.distributed function in the traceback."""
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in filename and "logger" not in filename:
            found = tb.tb_frame
        tb = tb.tb_next
    return found


def _caller_in_gigatron(tb: types.TracebackType | None) -> str | None:
    """`module.py:line (function)` of the innermost gigatron frame: where the collective ran."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = code.co_filename.replace("\\", "/")
        if "/gigatron/" in filename and not filename.endswith("/gigatron/faults.py"):
            short = filename[filename.rindex("/gigatron/") + 1 :]
            found = f"{short}:{tb.tb_lineno} ({code.co_name})"
        tb = tb.tb_next
    return found


def _group_ranks(frame: types.FrameType | None) -> list[int] | None:
    """Global ranks of the group the failed collective ran in (None when unknown)."""
    # why: torch loads only in commands that use it (gigatron --help stays fast)
    import torch.distributed as dist

    if frame is None:
        return None
    group = frame.f_locals.get("group")
    try:
        if group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - the group may be gone already
        return None


def unresponsive_ranks(
    ranks: list[int], rank: int, store: Any, wait_s: float = CHECK_IN_WAIT_S
) -> list[int] | None:
    """Ranks of `ranks` that do not check in within `wait_s` (every rank of a failed collective
    checks in); None when the store cannot be used."""
    try:
        store.set(_run_key(f"alive/{rank}"), "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in ranks if not store.check([_run_key(f"alive/{r}")])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - store unreachable (its host may be the stuck rank)
        return None


def describe_distributed_failure(
    error: BaseException, rank: int | None = None, store: Any = None
) -> DistributedFault:
    """A DistributedFault naming the collective, its group and the ranks that did not answer."""
    # why: torch loads only in commands that use it (gigatron --help stays fast)
    import torch.distributed as dist

    tb = error.__traceback__
    frame = _distributed_frame(tb)
    collective = frame.f_code.co_name if frame is not None else "a collective"
    where = _caller_in_gigatron(tb)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    ranks = _group_ranks(frame)
    timed_out = bool(_TIMEOUT.search(str(error)))
    what = "timed out" if timed_out else "lost its peer"
    waited = _WAITED_MS.search(str(error))
    after = f" after {int(waited.group(1)) / 1000:g} s" if waited and timed_out else ""
    parts = [f"rank {rank}: {collective}{' at ' + where if where else ''} {what}{after}"]
    if ranks is not None:
        parts.append(f"in the group of ranks {ranks}")
        peers = [r for r in ranks if r != rank]
        store = run_store() if store is None else store
        missing = unresponsive_ranks(ranks, rank, store) if store is not None else None
        if missing:
            label = "rank" if len(missing) == 1 else "ranks"
            parts.append(
                f"{label} {', '.join(map(str, missing))} did not answer (stopped, hung or dead)"
            )
        elif missing is None and peers:
            parts.append(f"one of ranks {peers} stopped answering")
    fix = (
        "; find out why that process stopped (or raise --distributed-timeout-minutes if it is "
        "only slow), then resume from the last checkpoint with --load"
    )
    return DistributedFault(", ".join(parts) + fix)


class DataLoaderFault(DistributedFault):
    """A data-loader worker process died (killed by a signal: the out-of-memory killer, a kill)."""


def describe_data_loader_failure(error: RuntimeError) -> DataLoaderFault | None:
    """torch's "DataLoader worker (pid ...) exited unexpectedly / is killed by signal" error as
    one line with what to do; None for any other error."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if not text.startswith("DataLoader worker (pid"):
        return None
    if "bus error" in text.lower():  # a fault reading a memory map: the file, not the memory
        return DataLoaderFault(
            f"a data-loader worker process died reading a memory-mapped data file "
            f"({text.rstrip('. ')}): a .bin, .idx or index-cache file was truncated or became "
            "unreadable (an I/O error) while the run read it. Restore the file, then resume "
            "with --load (--num-workers 0 names the file)",
            report_key="data-loader-fault",
        )
    return DataLoaderFault(
        f"a data-loader worker process died ({text.rstrip('. ')}); it was killed, often by the "
        "out-of-memory killer. Checkpoints already in --save are kept: resume with --load, with "
        "fewer --num-workers if memory is short (--num-workers 0 reads in the main process)",
        report_key="data-loader-fault",
    )


def worker_error_message(error: BaseException) -> str:
    """The message of an error raised in a data-loader worker: torch raises it again in the main
    process with the worker's whole traceback in the message; this keeps the original line."""
    text = str(error)
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]  # "package.module.ErrorClass: the original message"
    return last.partition(": ")[2] or last


def name_distributed_failures(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `function`; a collective timeout or lost peer inside it becomes a DistributedFault
    (described while the process groups still exist), a dead data-loader worker a
    DataLoaderFault."""
    try:
        return function(*args, **kwargs)
    except RuntimeError as error:
        data_fault = describe_data_loader_failure(error)
        if data_fault is not None:
            raise data_fault from error
        if not is_distributed_failure(error):
            raise
        raise describe_distributed_failure(error) from error
    except (ConnectionError, EOFError) as error:
        # A worker that dies while handing a batch over breaks the connection before torch
        # has noticed its death: ask torch about its workers.
        dead = _dead_worker_error()
        data_fault = describe_data_loader_failure(dead) if dead is not None else None
        if data_fault is None:
            raise
        raise data_fault from error


def _dead_worker_error(wait_s: float = 2.0) -> RuntimeError | None:
    """torch's error for a data-loader worker of this process that died, if one did within
    `wait_s` (the kernel reports the death a moment after the worker's sockets close)."""
    # why: torch only here, when a connection to a worker broke (faults.py loads without it)
    from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails

    deadline = time.monotonic() + wait_s
    while True:
        try:
            _error_if_any_worker_fails()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        except RuntimeError as error:  # raised by the check, or by torch's SIGCHLD handler
            return error


# ---- data-loader workers ------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when its parent dies (no orphaned worker printing
    connection errors); elsewhere torch's own watchdog stops the worker a little later."""
    if sys.platform.startswith("linux"):
        try:
            # why: ctypes: Linux only
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(0)


def _quiet_when_the_main_process_is_gone(previous: Callable[..., Any]) -> Callable[..., Any]:
    """An excepthook for workers: a broken connection to the main process (its end closes as it
    dies, a moment before the kernel kills the worker) is not worth a traceback."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, (ConnectionError, EOFError)):
            return
        previous(kind, value, tb)

    return hook


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM held back in this thread (delivered when the block ends): processes forked in
    the block start with it blocked in all their threads."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _end_on_the_parents_sigterm(parent_pid: int) -> None:
    """SIGTERM from the main process ends this worker; from anyone else it is ignored.

    torchrun signals each worker's whole process group: that SIGTERM is for the main process,
    which saves (--exit-signal-handler) and then stops its workers itself. The main process
    stops them with SIGTERM too (torch's loader after a short wait, and multiprocessing at
    interpreter exit, which then waits for them): a worker that ignored every SIGTERM would hang
    its main process at exit whenever a loader was still open. The sender is known only to
    sigwaitinfo, so SIGTERM must be blocked in every thread of the worker (`sigterm_blocked`
    around the fork: torch starts threads before this runs) and a watcher thread takes it; the
    no-op handler keeps a thread that does not block it from ending the worker."""
    if not hasattr(signal, "sigwaitinfo"):  # not on macOS: ignore all, as torchrun's matter more
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads torch starts later

    def watch() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="gigatron-worker-sigterm", daemon=True).start()


def data_loader_worker_init(parent_pid: int, worker_id: int) -> None:
    """`worker_init_fn` of gigatron's data loaders (bind `parent_pid` with functools.partial)."""
    _end_on_the_parents_sigterm(parent_pid)
    # multiprocessing's resource sharer (tensors sent to the main process) reports through this.
    sys.excepthook = _quiet_when_the_main_process_is_gone(sys.excepthook)
    _die_with_parent(parent_pid)


# ---- restart rounds under torchrun --max-restarts ---------------------------------------------
class RestartLedger:
    """Where each restart round of a torchrun run got to, kept in the agent's store (which
    outlives the rounds): rank 0 records the resumed and the last completed iteration. A new
    round names the iteration its predecessor failed in, and stops at once when the last two
    rounds failed in the same iteration (a fault that repeats: restarting cannot help)."""

    def __init__(self, store: Any, restart_round: int, rank: int) -> None:
        self.store, self.round, self.rank = store, restart_round, rank

    @classmethod
    def open(cls) -> RestartLedger | None:
        """The ledger of this torchrun run; None outside torchrun or without a store."""
        restart_round = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        store = run_store() if restart_round is not None else None
        if store is None:
            return None
        return cls(store, int(restart_round), int(os.environ.get("RANK", "0")))

    def _key(self, restart_round: int, name: str) -> str:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        return f"{_KEY_PREFIX}/{run}/restart/{restart_round}/{name}"

    def _read(self, restart_round: int, name: str) -> int | None:
        key = self._key(restart_round, name)
        return int(self.store.get(key)) if self.store.check([key]) else None

    def completed(self, iteration: int) -> None:
        """Rank 0: `iteration` is done (called after every iteration)."""
        if self.rank == 0:
            self.store.set(self._key(self.round, "completed"), str(iteration))

    def failed_iteration(self, restart_round: int) -> int | None:
        """The iteration round `restart_round` failed in (the one after its last completed)."""
        done = self._read(restart_round, "completed")
        start = self._read(restart_round, "resumed")
        if done is None and start is None:
            return None  # it failed before training started
        return (done if done is not None else start) + 1

    def begin(self, resumed: int, print_line: Callable[[str], None]) -> None:
        """At the start of training: record where this round resumes, name the previous round's
        failure, raise a GigatronError when the last two rounds failed in the same iteration."""
        if self.rank == 0:
            self.store.set(self._key(self.round, "resumed"), str(resumed))
        if self.round == 0:
            return
        failed = [self.failed_iteration(r) for r in range(self.round)]
        print_line(
            f"torchrun restart round {self.round}: round {self.round - 1} failed in iteration "
            f"{failed[-1]}; resuming at iteration {resumed + 1} from the newest checkpoint"
        )
        if len(failed) >= 2 and failed[-1] is not None and failed[-1] == failed[-2]:
            raise GigatronError(
                f"iteration {failed[-1]} failed in torchrun restart rounds {self.round - 2} and "
                f"{self.round - 1}: the fault repeats, restarting does not help; the first "
                "round's error above names its cause. Fix it, or skip the iteration with "
                f"--iterations-to-skip {failed[-1] - 1} (Megatron counts from 0)"
            )
