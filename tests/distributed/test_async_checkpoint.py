"""`--async-save` (torch_dist in the background): training steps run while a save is in flight,
the checkpoint holds the values of the iteration it was started at, it is published only once
written, and a kill -9 during the write leaves the previous checkpoint as the latest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from test_data_parallel import Case, build, train_steps

from gigatron.checkpoint import dcp_io, dist_format
from gigatron.checkpoint.async_save import AsyncCheckpointSaver
from gigatron.checkpoint.formats import load_checkpoint
from gigatron.parallel.context import ParallelContext, run_distributed

pytestmark = pytest.mark.distributed

CASE = Case("async", precision="bf16", distributed_optimizer=True)
STEPS_DURING_SAVE = 3


class GatedWriter(dcp_io.FileSystemWriter):
    """Writes only once `gate` is set: a save that takes as long as the test wants."""

    def __init__(self, path, gate: threading.Event, started: threading.Event) -> None:
        super().__init__(path)
        self.gate, self.started = gate, started

    def write_data(self, plan, planner):
        self.started.set()
        assert self.gate.wait(timeout=120), "the test never opened the gate"
        return super().write_data(plan, planner)


def run_async(rank: int, world_size: int, out_dir: str) -> None:
    pctx = ParallelContext.from_sizes()
    save_dir = Path(out_dir) / "ckpt"
    cfg, chunk, optimizer = build(CASE, pctx, use_ddp=True)
    cfg.checkpoint.ckpt_format = "torch_dist"
    train_steps(chunk, optimizer, pctx, range(2), use_ddp=True)
    saved_weights = {k: v.clone() for k, v in chunk.state_dict().items()}

    if rank == 0:  # a slow publish: no rank may go on (and read the tracker) before it is done
        publish = dist_format.publish_iteration
        dist_format.publish_iteration = lambda *args: (time.sleep(1.0), publish(*args))
    gate, started = threading.Event(), threading.Event()
    dcp_io.make_writer = lambda path: GatedWriter(path, gate, started)
    saver = AsyncCheckpointSaver(pctx)
    saver.save(save_dir, 2, [chunk], optimizer, None, cfg)
    assert started.wait(timeout=120)
    # Training goes on while the write is held back; the checkpoint is not published yet.
    during = []
    for i in range(2, 2 + STEPS_DURING_SAVE):
        train_steps(chunk, optimizer, pctx, range(i, i + 1), use_ddp=True)
        saver.poll()
        during.append(saver.in_flight)
    assert during == [True] * STEPS_DURING_SAVE
    assert not (save_dir / "latest_checkpointed_iteration.txt").exists()
    assert (save_dir / "iter_0000002.tmp").is_dir() and not (save_dir / "iter_0000002").exists()
    pctx.barrier()
    gate.set()
    saver.close()
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    # The checkpoint holds iteration 2's values, not those of the steps taken meanwhile, and
    # resuming from it repeats those steps exactly.
    after = train_steps(chunk, optimizer, pctx, range(5, 7), use_ddp=True)
    cfg2, chunk2, optimizer2 = build(CASE, pctx, use_ddp=True, seed=77)
    cfg2.checkpoint.ckpt_format = "torch_dist"
    assert load_checkpoint(save_dir, [chunk2], optimizer2, None, pctx, cfg2)["iteration"] == 2
    for key, value in chunk2.state_dict().items():
        assert torch.equal(value, saved_weights[key]), key
    again = train_steps(chunk2, optimizer2, pctx, range(2, 7), use_ddp=True)
    if rank == 0:
        torch.save({"after": torch.tensor(after), "again": torch.tensor(again)},
                   Path(out_dir) / "results.pt")  # fmt: skip


def test_training_continues_while_saving_and_the_checkpoint_is_the_saved_iteration(tmp_path):
    run_distributed(run_async, 2, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    # the resumed run took the 3 in-flight steps again, then the same 2 as the first run
    assert torch.equal(results["again"][STEPS_DURING_SAVE:], results["after"])


KILLED = textwrap.dedent(
    """
    import os, signal, sys, threading
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from test_data_parallel import Case, build, train_steps
    from gigatron.checkpoint import dcp_io, dist_format
    from gigatron.checkpoint.async_save import AsyncCheckpointSaver
    from gigatron.checkpoint.formats import save_checkpoint
    from gigatron.parallel.context import ParallelContext

    class Stuck(dcp_io.FileSystemWriter):
        def finish(self, metadata, results):  # data files written, index not yet
            written.set()
            threading.Event().wait()

    written = threading.Event()
    save_dir = Path({save_dir!r})
    pctx = ParallelContext.single()
    cfg, chunk, optimizer = build(Case("kill", distributed_optimizer=False), pctx, use_ddp=True)
    cfg.checkpoint.ckpt_format = "torch_dist"
    train_steps(chunk, optimizer, pctx, range(1), use_ddp=True)
    save_checkpoint(save_dir, 1, [chunk], optimizer, None, pctx, cfg)
    dcp_io.make_writer = Stuck
    saver = AsyncCheckpointSaver(pctx)
    train_steps(chunk, optimizer, pctx, range(1, 2), use_ddp=True)
    saver.save(save_dir, 2, [chunk], optimizer, None, cfg)
    assert written.wait(timeout=120)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_kill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    tests = str(Path(__file__).parent)
    script = KILLED.format(tests=tests, save_dir=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, timeout=300,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == -9, result.stderr
    assert list((tmp_path / "iter_0000002.tmp").glob("*.distcp"))  # killed mid-save
    assert not (tmp_path / "iter_0000002").exists()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    pctx = ParallelContext.single()
    cfg, chunk, optimizer = build(Case("kill", distributed_optimizer=False), pctx, use_ddp=True)
    cfg.checkpoint.ckpt_format = "torch_dist"
    assert load_checkpoint(tmp_path, [chunk], optimizer, None, pctx, cfg)["iteration"] == 1
