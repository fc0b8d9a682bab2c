"""`gigatron <args>` (or tests/gigatron_sequence.py's launch) in one process forked from a server
that imported torch once (multiprocessing's forkserver, the one `run_distributed` uses): a fresh
interpreter spends about 2.5 s of CPU importing torch and torch._dynamo before the command
starts, and the suite runs over a hundred such commands. The child behaves as
`python -m gigatron.cli <args>` would: its own session, the caller's working directory and
environment (one torch thread under OMP_NUM_THREADS=1), the platform's default start method,
standard input, output and error in files, the exit status, exit handlers run. Commands whose
start-up is under test run as real subprocesses (helpers.gigatron_command and helpers.run)."""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

from gigatron.parallel.context import FORKSERVER_PRELOAD

FORKSERVER = multiprocessing.get_context("forkserver")


def _redirect(folder: str) -> None:
    for name, fd, mode in (("stdin", 0, os.O_RDONLY), ("stdout", 1, os.O_WRONLY),
                           ("stderr", 2, os.O_WRONLY)):  # fmt: skip
        handle = os.open(os.path.join(folder, name), mode)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # multiprocessing closed its stdin


def _child(entry: str, args: list[str], folder: str, environment: dict[str, str], cwd: str):
    os.setsid()  # a timeout kills the command and whatever it started, as helpers.run does
    # A forkserver's child inherits its start method; a fresh interpreter has the platform's.
    multiprocessing.set_start_method(None, force=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    _redirect(folder)
    import torch

    if environment.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    module, function = entry.split(":")
    sys.argv = [module, *args]
    try:
        code = getattr(importlib.import_module(module), function)(args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def run_forked(
    entry: str,
    args: Sequence[str],
    environment: dict[str, str],
    timeout: float,
    cwd: str | os.PathLike | None = None,
    stdin: str = "",
) -> subprocess.CompletedProcess:
    """`entry` ("module:function", called with the list `args`, returning an exit status) in a
    forked child, in `cwd`, reading `stdin`; (args, exit status, stdout, stderr) as
    subprocess.run gives them. Past `timeout` seconds the child's session is killed and
    AssertionError names the command and what it printed."""
    FORKSERVER.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    with tempfile.TemporaryDirectory(prefix="gigatron-forked-") as folder:
        for name, text in (("stdin", stdin), ("stdout", ""), ("stderr", "")):
            with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        directory = os.fspath(cwd) if cwd is not None else os.getcwd()
        process = FORKSERVER.Process(
            target=_child, args=(entry, list(args), folder, environment, directory)
        )
        process.start()
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            os.killpg(process.pid, signal.SIGKILL)
            process.join()
        stdout, stderr = (
            open(os.path.join(folder, name), encoding="utf-8", errors="replace").read()
            for name in ("stdout", "stderr")
        )
    command = [entry, *args]
    if timed_out:
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(command)}\n"
            f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)


def run_forked_cli(args: Sequence[str], *rest: Any, **kw: Any) -> subprocess.CompletedProcess:
    """`gigatron <args>` in a forked child; `rest`, `kw`: run_forked's after `args`."""
    result = run_forked("gigatron.cli:main", args, *rest, **kw)
    result.args = ["gigatron", *args]
    return result
