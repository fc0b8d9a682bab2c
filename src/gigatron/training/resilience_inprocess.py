"""In-process restart (`--inprocess-restart`): when a training step fails on one rank (an error
raised there, or a collective that timed out or lost its peer), every rank leaves its process
groups, the ranks meet again through the launcher's store under a new prefix, rebuild the run
from the newest checkpoint in --save and continue, in the same processes (no launcher restart,
no new Python start-up). Bounded by --inprocess-max-iterations restarts. A process that died
cannot be replaced this way: the others stop after --inprocess-barrier-timeout naming it (under
torchrun the agent already stops them when a worker exits; docs/resilience.md)."""

from __future__ import annotations

import copy
import datetime
import os
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.faults import DistributedFault
from gigatron.parallel.context import init_default_group, resolve_backend, resolve_device

T = TypeVar("T")
DEFAULT_MAX_RESTARTS = 3


def is_restartable(error: BaseException) -> bool:
    """A fault of the run (a failed collective, an error of the step), not of the user's input
    nor a reproduced NaN: restarting can help only the former."""
    if isinstance(error, DistributedFault):
        return True
    return isinstance(error, Exception) and not isinstance(error, GigatronError)


def check_inprocess_restart(cfg: GigatronConfig) -> None:
    """--inprocess-restart resumes from --save, and meets the other ranks in torchrun's store."""
    if not cfg.parallel.inprocess_restart:
        return
    if not cfg.checkpoint.save:
        raise GigatronError(
            "--inprocess-restart: the restarted ranks resume from the newest checkpoint in "
            "--save; add --save DIR (and --save-interval N)"
        )
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several and os.environ.get("TORCHELASTIC_RESTART_COUNT") is None:
        raise GigatronError(
            "--inprocess-restart: the ranks meet again through torchrun's store, which outlives "
            "a failed process group; launch with torchrun"
        )


def restarting_in_process(
    cfg: GigatronConfig, attempt: Callable[[GigatronConfig], T], print_line: Callable[[str], None]
) -> T:
    """`attempt(cfg)`; on a restartable fault, leave the groups (the attempt's own cleanup),
    meet the other ranks again and call `attempt` with --load set to --save, at most
    --inprocess-max-iterations times."""
    check_inprocess_restart(cfg)
    limit = cfg.parallel.inprocess_max_iterations
    limit = DEFAULT_MAX_RESTARTS if limit is None else limit
    resumed = copy.deepcopy(cfg)
    resumed.checkpoint.load = cfg.checkpoint.save
    restarts = 0
    while True:
        try:
            return attempt(cfg if restarts == 0 else resumed)
        except Exception as error:
            if not is_restartable(error) or restarts >= limit:
                raise
            cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        restarts += 1
        print_line(
            f"in-process restart {restarts} of {limit}: {cause}; meeting the other ranks "
            f"again and resuming from the newest checkpoint in {cfg.checkpoint.save}"
        )
        _rejoin(cfg, restarts)


def abort_process_groups() -> None:
    """Close every process group of this rank at once, so that the other ranks waiting in a
    collective on it fail now instead of at --distributed-timeout-minutes. A destroyed Gloo group
    closes its connections only when the last reference goes, and the failed step's model still
    holds its groups; torch's abort closes them regardless (a private torch function, hence the
    fallback to the plain destroy)."""
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


def _rejoin(cfg: GigatronConfig, restarts: int) -> None:
    """A fresh default process group under the prefix of this in-process round."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return  # one process: nothing to meet
    p = cfg.parallel
    init_default_group(
        resolve_backend(p.distributed_backend, resolve_device(p.device)),
        datetime.timedelta(minutes=p.distributed_timeout_minutes),
        inprocess_round=restarts,
        join_timeout_s=float(p.inprocess_barrier_timeout),
    )
