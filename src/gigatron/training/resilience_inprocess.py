"""In-process restart (`--inprocess-restart`): when a training step fails on one rank (an error
raised there, or a collective that timed out or lost its peer), every rank leaves its process
groups, the live processes meet again through the launch's store in a new round, rebuild the run
from the newest checkpoint in --save and continue, in the same processes (no launcher restart,
no new Python start-up). Bounded by --inprocess-max-iterations restarts. Processes beyond
--inprocess-active-world-size wait as warm spares and take the place of processes that died
(found by their silent heartbeats), under a launcher that keeps the survivors running (torchrun's
agent stops them all when a worker exits; docs/resilience.md)."""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.faults import DistributedFault
from gigatron.parallel.context import resolve_backend, resolve_device

T = TypeVar("T")
DEFAULT_MAX_RESTARTS = 3
POLL_S = 0.05  # how often a waiting process looks at the store


def is_restartable(error: BaseException) -> bool:
    """A fault of the run (a failed collective, an error of the step), not of the user's input
    nor a reproduced NaN: restarting can help only the former."""
    if isinstance(error, DistributedFault):
        return True
    return isinstance(error, Exception) and not isinstance(error, GigatronError)


def check_inprocess_restart(cfg: GigatronConfig) -> None:
    """--inprocess-restart resumes from --save, and meets the other ranks in the launch's store."""
    p = cfg.parallel
    if not p.inprocess_restart:
        return
    if not cfg.checkpoint.save:
        raise GigatronError(
            "--inprocess-restart: the restarted ranks resume from the newest checkpoint in "
            "--save; add --save DIR (and --save-interval N)"
        )
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise GigatronError(
            "--inprocess-restart: the ranks meet again through the store at MASTER_ADDR:"
            "MASTER_PORT; launch with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    if p.inprocess_heartbeat_timeout <= p.inprocess_heartbeat_interval:
        raise GigatronError(
            f"--inprocess-heartbeat-timeout {p.inprocess_heartbeat_timeout:g}: must exceed "
            f"--inprocess-heartbeat-interval {p.inprocess_heartbeat_interval:g}, or live "
            "processes count as dead"
        )


def active_world_size(argv: Sequence[str], world_size: int) -> int:
    """The processes that train: --inprocess-active-world-size when given (the others of the
    launch wait as spares), else all of them. Read before the config is validated, which
    checks the parallel layout against it."""
    reader = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    reader.add_argument("--inprocess-active-world-size", type=int, default=None)
    reader.add_argument("--inprocess-restart", action="store_true")
    flags = reader.parse_known_args(list(argv))[0]
    active = flags.inprocess_active_world_size
    if active is None:
        return world_size
    if not flags.inprocess_restart:
        raise GigatronError(
            f"--inprocess-active-world-size {active}: spares replace ranks only with "
            "--inprocess-restart; add it, or launch only the processes that train"
        )
    if not 1 <= active <= world_size:
        raise GigatronError(
            f"--inprocess-active-world-size {active}: must be between 1 and the {world_size} "
            "launched processes (the others wait as spares)"
        )
    return active


def restarting_in_process(
    cfg: GigatronConfig, attempt: Callable[[GigatronConfig], T], print_line: Callable[[str], None]
) -> T | None:
    """`attempt(cfg)` on the active ranks; on a restartable fault, leave the groups, meet the
    other live processes again (spares take the place of dead ranks) and call `attempt` with
    --load set to --save, at most --inprocess-max-iterations times. A spare returns None when
    the run ends without needing it."""
    check_inprocess_restart(cfg)
    limit = cfg.parallel.inprocess_max_iterations
    limit = DEFAULT_MAX_RESTARTS if limit is None else limit
    resumed = copy.deepcopy(cfg)
    resumed.checkpoint.load = cfg.checkpoint.save
    rounds = Rounds.open(cfg)
    try:
        for restarts in range(limit + 1):
            if rounds is not None and not rounds.take_role(restarts, print_line):
                if rounds.wait_as_spare(restarts):
                    return None  # the run ended without this spare
                continue
            try:
                result = attempt(cfg if restarts == 0 else resumed)
            except Exception as error:
                cause = str(error).splitlines()[0] if str(error) else type(error).__name__
                if not is_restartable(error) or restarts >= limit:
                    _end(rounds, f"failed: {cause}")
                    raise
            else:
                _end(rounds, "done")
                return result
            if rounds is not None:
                rounds.report_fault(restarts, cause)
            print_line(
                f"in-process restart {restarts + 1} of {limit}: {cause}; meeting the other "
                f"ranks again and resuming from the newest checkpoint in {cfg.checkpoint.save}"
            )
            _leave_groups()
        raise AssertionError("unreachable: the last round returns or raises")
    finally:
        if rounds is not None:
            rounds.close()


def _end(rounds: Rounds | None, outcome: str) -> None:
    if rounds is not None:
        rounds.end(outcome)


def _leave_groups() -> None:
    """Drop this rank's groups; collecting the failed attempt's objects closes their Gloo
    sockets, so that peers still waiting on this rank fail now."""
    abort_process_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def abort_process_groups() -> None:
    """Abort every process group of this rank (NCCL: its communicators end now), else destroy
    them. torch's abort (a private torch function, hence the fallback) does nothing for Gloo: a
    Gloo group closes its connections only when its last reference goes (`_leave_groups`)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
            return
    except Exception:  # noqa: BLE001 - an abort that fails leaves the plain destroy to do it
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- rounds: who trains, who waits, who died (kept in the launcher's store) --------------------
class Rounds:
    """The in-process rounds of a multi-process run. Every launched process writes a heartbeat
    counter to the store; in round k the live processes check in, the first to see every
    process either checked in or silent for --inprocess-heartbeat-timeout closes the round with
    the list of those that came, the first --inprocess-active-world-size of them (by launch
    rank) train as ranks 0.. of a fresh process group, and the others wait as spares for the
    next round or the end of the run."""

    def __init__(self, cfg: GigatronConfig, store: Any, beat_store: Any, launch: tuple[int, int]):
        p = cfg.parallel
        self.cfg, self.store = cfg, store
        self.rank, self.world = launch
        self.active = p.inprocess_active_world_size or self.world
        self.prefix = _key_prefix()
        self.beats = BeatWatch(store, self.prefix, self.world, p.inprocess_heartbeat_timeout)
        self._stop = threading.Event()
        self._beater = threading.Thread(
            target=_beat,
            args=(beat_store, f"{self.prefix}/beat/{self.rank}", p.inprocess_heartbeat_interval),
            kwargs={"stop": self._stop},
            name="gigatron-heartbeat",
            daemon=True,
        )
        self._beater.start()

    @classmethod
    def open(cls, cfg: GigatronConfig) -> Rounds | None:
        """The rounds of this launch; None for a single process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank = int(os.environ.get("RANK", "0"))
        store = _store_client(host=rank == 0)
        beat_store = _store_client(host=False)  # the heartbeat thread's own client
        return cls(cfg, store, beat_store, (rank, world))

    def _key(self, restart: int, name: str) -> str:
        return f"{self.prefix}/{restart}/{name}"

    def take_role(self, restart: int, print_line: Callable[[str], None]) -> bool:
        """Meet the live processes of round `restart`; True (with the default process group of
        the active ranks made) when this process trains in it, False when it waits."""
        members = self._meet(restart)
        if len(members) < self.active:
            dead = sorted(set(range(self.world)) - set(members))
            raise DistributedFault(
                f"in-process restart {restart}: {len(members)} processes left (launch ranks "
                f"{', '.join(map(str, dead))} gone), fewer than the {self.active} of "
                "--inprocess-active-world-size: no spare left. The newest checkpoint in --save "
                "is kept: resume with --load",
                report_key="inprocess-no-spare",
            )
        if self.rank not in members[: self.active]:
            if restart == 0 or self.rank not in members:
                print_line(f"launch rank {self.rank}: waiting as a spare (round {restart})")
            return False
        new_rank = members.index(self.rank)
        if restart and members[: self.active] != list(range(self.active)):
            print_line(f"launch rank {self.rank} trains as rank {new_rank} (round {restart})")
        os.environ.update(RANK=str(new_rank), WORLD_SIZE=str(self.active))
        self._init_group(restart, new_rank)
        return True

    def _init_group(self, restart: int, new_rank: int) -> None:
        p = self.cfg.parallel
        dist.init_process_group(
            backend=resolve_backend(p.distributed_backend, resolve_device(p.device)),
            store=dist.PrefixStore(self._key(restart, "group"), self.store),
            rank=new_rank,
            world_size=self.active,
            timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes),
        )

    def _meet(self, restart: int) -> list[int]:
        """The launch ranks of round `restart`, the same list on every process."""
        self.store.set(self._key(restart, f"arrived/{self.rank}"), "1")
        members_key = self._key(restart, "members")
        deadline = time.monotonic() + float(self.cfg.parallel.inprocess_barrier_timeout)
        while not self.store.check([members_key]):
            arrived = [
                r
                for r in range(self.world)
                if self.store.check([self._key(restart, f"arrived/{r}")])
            ]
            silent = self.beats.silent()
            if all(r in arrived or r in silent for r in range(self.world)):
                self.store.compare_set(members_key, "", json.dumps(arrived))
            elif time.monotonic() > deadline:
                self.store.compare_set(members_key, "", json.dumps(arrived))
            else:
                time.sleep(POLL_S)
        return json.loads(self.store.get(members_key))

    def wait_as_spare(self, restart: int) -> bool:
        """Wait while round `restart` trains: True when the run ended, False on a fault (the
        spare meets the others in the next round)."""
        fault_key, end_key = self._key(restart, "fault"), f"{self.prefix}/end"
        while True:
            if self.store.check([end_key]):
                return True
            if self.store.check([fault_key]):
                return False
            time.sleep(POLL_S)

    def report_fault(self, restart: int, cause: str) -> None:
        """Tell the spares that round `restart` failed: they meet the others in the next."""
        self.store.set(self._key(restart, "fault"), f"launch rank {self.rank}: {cause}")

    def end(self, outcome: str) -> None:
        """The run ended here (`done` or `failed: ...`): the spares stop waiting."""
        self.store.compare_set(f"{self.prefix}/end", "", outcome)

    def close(self) -> None:
        self._stop.set()


class BeatWatch:
    """Which processes stopped beating: a counter unchanged for `timeout_s` of this process's
    own clock (no clocks compared across machines)."""

    def __init__(self, store: Any, prefix: str, world: int, timeout_s: float) -> None:
        self.store, self.prefix, self.world, self.timeout_s = store, prefix, world, timeout_s
        self._seen: dict[int, tuple[int, float]] = {}

    def silent(self) -> set[int]:
        now, quiet = time.monotonic(), set()
        for rank in range(self.world):
            count = self.store.add(f"{self.prefix}/beat/{rank}", 0)
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now)
            elif now - last[1] > self.timeout_s:
                quiet.add(rank)
        return quiet


def _beat(store: Any, key: str, interval_s: float, stop: threading.Event) -> None:
    """Add one to `key` every `interval_s` until `stop` (a store that went away ends it)."""
    try:
        while True:
            store.add(key, 1)
            if stop.wait(interval_s):
                return
    except Exception:  # noqa: BLE001 - the run's store is gone: the run is ending
        return


def _key_prefix() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"gigatron/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/inprocess"


def _store_client(host: bool) -> Any:
    """A client of the store at MASTER_ADDR:MASTER_PORT: the launcher's (torchrun's agent, or
    TORCHELASTIC_USE_AGENT_STORE=True under another launcher), which outlives any rank; else
    launch rank 0 hosts it (then rank 0 must not die)."""
    hosted_by_launcher = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=host and not hosted_by_launcher,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
    )
