"""--exit-signal-handler under torchrun: SIGTERM to the ranks (what a scheduler that signals
every process of the job does) saves, and every rank and torchrun itself exit with status 0 and
no traceback. (SIGTERM to torchrun alone makes torchrun raise its own SignalException: status 1,
a traceback from torch's launcher, after the ranks have saved; docs/training.md says so.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TINY = [
    "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
    "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_sigterm_to_the_ranks_saves_and_everything_exits_0(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", "-m", "gigatron.cli", "pretrain", "gpt", *TINY,
               "--train-iters", "100000", "--exit-signal-handler", "--save", str(tmp_path),
               "--metrics-file", str(tmp_path / "metrics.jsonl")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 180
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and '"type": "train"' in metrics.read_text()):
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "no iteration logged in time"
            time.sleep(0.2)
        ranks = _children(process.pid)
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
    saved = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert f"exiting at iteration {saved} (signal)" in output, output
    assert (tmp_path / f"iter_{saved:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()
