"""Runs several `gigatron` commands one after another in this process; with a process count
over 1, in that many ranks forked from this process, all in the one launch (each command gets a
fresh process group on a store shared by the launch, as a command destroys the group it ran in),
so several configurations cost one launch. Started by helpers.gigatron_sequence (`main` in a
child of tests/forked_cli.py's forkserver) or as `python gigatron_sequence.py SPEC [NPROC]`,
SPEC a JSON file of [[stdout file, [command, args...]], ...]: each command's standard output
goes to its file.

Why fork instead of torchrun: a fresh interpreter spends about 2.5 s of CPU importing torch (and
torch._dynamo, which AdamW pulls in) before its first step; the ranks forked here share this
process's imports, and no launcher process is started. torchrun itself is tested where its own
behaviour matters (tests/e2e/test_torchrun_restart.py, test_multinode.py, the README commands)."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch._dynamo  # noqa: F401  (AdamW imports it: the ranks inherit it instead)
import torch.distributed as dist

from gigatron import cli


def join_process_group(store: dist.Store | None, index: int) -> None:
    """Create the default process group for command `index` unless one exists (a rank that
    fails alone leaves the others waiting: they give up after 5 minutes)."""
    if store is None or dist.is_initialized():
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"command{index}", store), rank=rank,
        world_size=world_size, timeout=datetime.timedelta(minutes=5),
    )  # fmt: skip


def run_all(runs: list[tuple[str, list[str]]], store: dist.Store | None) -> int:
    """0 when every command exits 0; else the first failure's exit status, its output on stderr."""
    for index, (stdout_file, args) in enumerate(runs):
        join_process_group(store, index)
        with open(stdout_file, "a", encoding="utf-8") as out, contextlib.redirect_stdout(out):
            code = cli.main(args)
        if code != 0:
            print(f"exit {code}: gigatron {' '.join(args)}", file=sys.stderr)
            print(Path(stdout_file).read_text(encoding="utf-8"), file=sys.stderr)
            return code
    return 0


def run_rank(spec: Path) -> int:
    """This rank's run of every command (RANK and WORLD_SIZE in the environment, as torchrun
    sets them)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # One file store per launch (the spec's name is unique): the commands' groups meet there.
    store = dist.FileStore(f"{spec}.store", world_size) if world_size > 1 else None
    try:
        return run_all(json.loads(spec.read_text(encoding="utf-8")), store)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fork_ranks(spec: Path, nproc: int) -> int:
    """Fork `nproc` ranks with torchrun's environment variables; 0 when all exit 0, else the
    first failure's status, the other ranks killed (as torchrun does)."""
    for _, args in json.loads(spec.read_text(encoding="utf-8")):
        importlib.import_module(cli.COMMANDS[args[0]][0].split(":")[0])  # once, for every rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = {}
    for rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
            status = 1
            try:
                status = run_rank(spec)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        pids[pid] = rank
    return wait_for_ranks(pids)


def wait_for_ranks(pids: dict[int, int]) -> int:
    """Reap the ranks; on the first failure kill the rest (the caller's timeout bounds a hang)."""
    status = 0
    while pids:
        pid, code = os.wait()
        pids.pop(pid, None)
        code = os.waitstatus_to_exitcode(code)
        if code != 0 and status == 0:
            status = code if code > 0 else 1
            time.sleep(1)  # let the failing rank's peers print what they saw
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return status


def main(argv: list[str]) -> int:
    """`SPEC [NPROC]`: every command of SPEC in one process, or in NPROC forked ranks."""
    spec, nproc = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 1
    return fork_ranks(spec, nproc) if nproc > 1 else run_rank(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
