"""--inprocess-restart's decisions: which faults restart, the bound, the resumed --load, the
flags it needs, and the rejoin barrier naming the ranks that did not come back."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.faults import DistributedFault
from gigatron.parallel.context import wait_for_ranks
from gigatron.training.resilience_inprocess import is_restartable, restarting_in_process


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
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(GigatronError, match="launch with torchrun"):
        restarting_in_process(config(tmp_path), attempt, print)


def test_the_rejoin_barrier_names_the_ranks_that_did_not_come():
    store = dist.HashStore()
    store.set("joined/2", "1")
    with pytest.raises(GigatronError, match=r"ranks 1, 3 did not rejoin within 0.2 s"):
        wait_for_ranks(store, 0, 4, 0.2)
    for rank in (1, 3):
        store.set(f"joined/{rank}", "1")
    wait_for_ranks(store, 0, 4, 0.2)  # everyone: returns
