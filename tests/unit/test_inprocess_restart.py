"""--inprocess-restart's decisions: which faults restart, the bound, the resumed --load, the
flags it needs, the active world size, and which processes count as dead."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.faults import DistributedFault
from gigatron.training.resilience_inprocess import (
    BeatWatch,
    active_world_size,
    is_restartable,
    restarting_in_process,
)


def config(tmp_path, limit=None) -> GigatronConfig:
    cfg = GigatronConfig()
    cfg.parallel.inprocess_restart = True
    cfg.parallel.inprocess_max_iterations = limit
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    return cfg


def test_faults_restart_and_input_errors_do_not():
    assert is_restartable(RuntimeError("gloo: connection reset by peer"))
    assert is_restartable(DistributedFault("rank 0: all_reduce timed out"))
    assert not is_restartable(GigatronError("--lr: must be positive"))
    assert not is_restartable(KeyboardInterrupt())


def test_a_failing_attempt_is_retried_from_save_at_most_the_limit(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lines, loads = [], []

    def attempt(cfg):
        loads.append(cfg.checkpoint.load)
        if len(loads) < 3:
            raise RuntimeError(f"fault {len(loads)}\nsecond line")
        return "done"

    assert restarting_in_process(config(tmp_path), attempt, lines.append) == "done"
    assert loads == [None, str(tmp_path / "ckpt"), str(tmp_path / "ckpt")]
    assert lines[0] == (
        "in-process restart 1 of 3: fault 1; meeting the other ranks again and resuming from "
        f"the newest checkpoint in {tmp_path / 'ckpt'}"
    )
    loads.clear()
    with pytest.raises(RuntimeError, match="fault 2"):
        restarting_in_process(config(tmp_path, limit=1), attempt, lines.append)
    assert len(loads) == 2


def test_an_input_error_is_not_retried_and_save_is_required(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    calls = []

    def attempt(cfg):
        calls.append(1)
        raise GigatronError("--data-path x: not found")

    with pytest.raises(GigatronError, match="--data-path"):
        restarting_in_process(config(tmp_path), attempt, print)
    assert calls == [1]
    cfg = config(tmp_path)
    cfg.checkpoint.save = None
    with pytest.raises(GigatronError, match="--inprocess-restart: .* add --save DIR"):
        restarting_in_process(cfg, attempt, print)
    cfg.checkpoint.save = str(tmp_path)
    cfg.parallel.inprocess_heartbeat_timeout = 30
    with pytest.raises(GigatronError, match="--inprocess-heartbeat-timeout 30: must exceed"):
        restarting_in_process(cfg, attempt, print)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(GigatronError, match="launch with torchrun"):
        restarting_in_process(config(tmp_path), attempt, print)


def test_the_active_world_size_leaves_the_other_processes_as_spares():
    assert active_world_size(["--lr", "1e-3"], 5) == 5
    restart = ["--inprocess-restart"]
    assert active_world_size([*restart, "--inprocess-active-world-size", "4"], 5) == 4
    assert active_world_size(["--inprocess-active-world-size=2", *restart], 5) == 2
    with pytest.raises(GigatronError, match="--inprocess-active-world-size 6: must be between 1"):
        active_world_size([*restart, "--inprocess-active-world-size", "6"], 5)
    with pytest.raises(GigatronError, match="only with --inprocess-restart; add it"):
        active_world_size(["--inprocess-active-world-size", "4"], 5)


def test_a_process_is_dead_when_its_heartbeat_counter_stops(monkeypatch):
    store, now = dist.HashStore(), [100.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    watch = BeatWatch(store, "p", 3, timeout_s=2.0)
    assert watch.silent() == set()  # first look: every counter is new
    now[0] += 1.5
    store.add("p/beat/0", 1)
    assert watch.silent() == set()
    now[0] += 1.0  # rank 0 beat 1 s ago, ranks 1 and 2 not for 2.5 s
    store.add("p/beat/2", 1)
    assert watch.silent() == {1}
