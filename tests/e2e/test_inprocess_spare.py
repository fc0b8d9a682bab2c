"""In-process restart with a warm spare: 4 training processes and 1 spare share a store hosted by
the launcher (here the test, as torchrun's agent would); SIGKILL of one training process after
iteration 3 is logged. The survivors see the lost peer at once, meet the spare under a new round,
resume from the newest checkpoint and finish with the losses of an uninterrupted run (compared
with a single-process run of the same global batch), within 60 s of the kill."""

from __future__ import annotations

import datetime
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from helpers import NO_DROPOUT, env, pretrain, tiny_gpt_flags, train_values

FLAGS = [
    *tiny_gpt_flags(), *NO_DROPOUT, "--global-batch-size", "8", "--train-iters", "6",
    "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--deterministic-mode",
    "--distributed-backend", "gloo",
]  # fmt: skip
SPARE_FLAGS = [
    "--save-interval", "2", "--inprocess-restart", "--inprocess-active-world-size", "4",
    "--inprocess-heartbeat-interval", "0.5", "--inprocess-heartbeat-timeout", "2",
    "--inprocess-barrier-timeout", "30",
]  # fmt: skip
LOSS = re.compile(r"iteration\s+(\d+)/.*\| lm loss: (\S+) \|")


def launch(rank: int, port: int, save: str) -> subprocess.Popen:
    environment = env(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="5", LOCAL_WORLD_SIZE="5",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
    )  # fmt: skip
    command = [sys.executable, "-m", "gigatron.cli", "pretrain", "gpt", *FLAGS, *SPARE_FLAGS]
    return subprocess.Popen(
        [*command, "--save", save], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=environment,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_spare_replaces_a_killed_rank_and_the_run_ends_with_the_uninterrupted_losses(tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    processes = [launch(rank, port, str(tmp_path / "ckpt")) for rank in range(5)]
    outputs: list[list[str]] = [[] for _ in processes]
    killed_at: list[float] = []

    def read(rank: int) -> None:
        for line in processes[rank].stdout:
            outputs[rank].append(line)
            if " iteration        3/" in line and not killed_at:
                processes[1].send_signal(signal.SIGKILL)  # launch rank 1 trains as rank 1
                killed_at.append(time.monotonic())

    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(5)]
    for reader in readers:
        reader.start()
    try:
        codes = [process.wait(timeout=240) for process in processes]
    finally:
        for process in processes:
            process.kill()
    ended = time.monotonic()
    for reader in readers:
        reader.join(5)
    text = ["".join(lines) for lines in outputs]
    assert codes == [0, -signal.SIGKILL, 0, 0, 0], "\n".join(text)
    assert killed_at and ended - killed_at[0] < 60, "\n".join(text)
    assert "launch rank 4: waiting as a spare (round 0)" in text[4]
    assert "launch rank 4 trains as rank 3 (round 1)" in text[4]
    assert "in-process restart 1 of 3: rank 0: all_reduce" in text[0]
    before = {int(i): float(v) for i, v in LOSS.findall(text[3])}  # the last rank logs
    after = {int(i): float(v) for i, v in LOSS.findall(text[4])}  # the spare is the last now
    # The kill lands after iteration 3 (checkpoint 2), or on a slow reader after checkpoint 4.
    resumed = int(re.search(r"loaded checkpoint \S+ at iteration (\d+)", text[4]).group(1))
    assert resumed in (2, 4) and sorted(after) == list(range(resumed + 1, 7))
    single = pretrain("gpt", *FLAGS, "--metrics-file", str(tmp_path / "one.jsonl"))
    reference = train_values(tmp_path / "one.jsonl")
    assert sorted(reference) == list(range(1, 7))
    assert before[3] == pytest.approx(reference[3], rel=1e-5), single.stdout
    assert after == pytest.approx({i: reference[i] for i in after}, rel=1e-5)
    del store
