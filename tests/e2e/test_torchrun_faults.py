"""Faults under torchrun, end to end: SIGTERM to torchrun with data-loader workers saves and exits
cleanly, an error every rank hits is printed once with a one-failure summary, and a killed run
leaves no data-loader worker behind printing tracebacks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import env, gigatron_command, run, tiny_gpt_flags, wait_for_train_record

pytestmark = pytest.mark.distributed

TINY = [
    *tiny_gpt_flags(hidden_size=32), "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip


def _torchrun(nproc: int, *flags: str) -> list[str]:
    return gigatron_command("pretrain", "gpt", *flags, nproc=nproc)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _kill_tree(process: subprocess.Popen, known: list[int]) -> None:
    """Kill `process` and every process it started (workers may sit in their own sessions)."""
    for pid in {*known, *_descendants(process.pid)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


def test_sigterm_to_torchrun_with_data_loader_workers_saves_and_exits(tmp_path):
    """torchrun sends SIGTERM to each worker's whole process group, data-loader workers included:
    they must not die before the main process has saved."""
    command = _torchrun(
        2, *TINY, "--train-iters", "100000", "--num-workers", "2", "--exit-signal-handler",
        "--save", str(tmp_path), "--metrics-file", str(tmp_path / "metrics.jsonl"),
    )  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()
    )
    known: list[int] = []
    try:
        wait_for_train_record(tmp_path / "metrics.jsonl", process, 120)
        known = _descendants(process.pid)
        assert len(known) >= 2 + 2 * 2, "expected 2 ranks with 2 data-loader workers each"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=90)
    finally:
        _kill_tree(process, known)
    assert "killed by signal" not in output and "exited unexpectedly" not in output, output
    saved = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert f"exiting at iteration {saved} (signal)" in output, output
    # dp = 2: one file for the one (tp, pp) position.
    assert (tmp_path / f"iter_{saved:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    # torchrun itself ends with its SignalException; no gigatron process failed.
    assert not re.search(r'File ".*/gigatron/', output), output
    # Nothing is left running: the workers went with their main processes.
    time.sleep(1.0)
    assert [pid for pid in known if _alive(pid)] == []


def test_an_error_on_every_rank_is_printed_once(tmp_path):
    command = _torchrun(4, *TINY, "--hidden-size", "30", "--train-iters", "2")
    result = run(command, check=False, timeout=180)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    line = (
        "gigatron pretrain: error: invalid configuration:\n  - --hidden-size 30 is not "
        "divisible by --num-attention-heads 4"
    )
    assert output.count(line) == 1, output
    # torchrun's summary names the message as the root cause (instead of a link to a file).
    # Ranks slower to reach the check may be stopped by torchrun first (SIGTERM), so only the
    # root cause is asserted; no rank prints a Python traceback of gigatron's code.
    summary = output[output.index("Root Cause") :]
    assert "--hidden-size 30 is not divisible" in summary, summary
    assert not re.search(r'File ".*/gigatron/', output), output
    # The ranks that hit the same error left with status 0: one failure with an exit code.
    failures = output[output.index("Failures:") :]
    assert len(re.findall(r"exitcode\s*:\s*2 ", failures)) == 1, failures


def test_a_killed_run_leaves_no_worker_behind(tmp_path):
    """Workers that outlive their main process print connection errors when they next touch
    it (torch's own watchdog notices only every 5 s): they must go with it."""
    metrics = tmp_path / "metrics.jsonl"
    command = gigatron_command(
        "pretrain", "gpt", *TINY, "--train-iters", "100000", "--num-workers", "2",
        "--metrics-file", str(metrics),
    )  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env()
    )
    workers: list[int] = []
    try:
        wait_for_train_record(metrics, process, 120)
        # Forked workers share the main process's command line (unlike helpers such as
        # multiprocessing's resource tracker, which leaves on its own when the main has gone).
        main_cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        workers = [pid for pid in _descendants(process.pid) if _cmdline(pid) == main_cmdline]
        assert len(workers) >= 2
        process.send_signal(signal.SIGKILL)
        start = time.monotonic()
        # stderr closes when the last process holding it (main or worker) is gone.
        _, stderr = process.communicate(timeout=30)
        while [p for p in workers if _alive(p)] and time.monotonic() < start + 10:
            time.sleep(0.05)  # closing stderr is one of a dying process's last steps
        lived = time.monotonic() - start
    finally:
        _kill_tree(process, workers)
    assert lived < 2.0, f"data-loader workers outlived their main process by {lived:.1f} s"
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
