"""`gigatron pretrain --async-save`: the checkpoints equal those of a synchronous run, and each is
published (tracker file) only after its background write."""

from __future__ import annotations

from pathlib import Path

import torch

from gigatron.checkpoint.dist_format import read_full_tensors
from gigatron.training.pretrain import main as pretrain_main
from helpers import tiny_gpt_flags

TINY = [
    "gpt", *tiny_gpt_flags(hidden_size=32), "--global-batch-size", "4", "--lr", "1e-3",
    "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--deterministic-mode", "--hidden-dropout", "0", "--attention-dropout", "0", "--ckpt-format",
    "torch_dist", "--save-interval", "2",
]  # fmt: skip


def test_async_save_writes_the_same_checkpoints(tmp_path: Path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        assert pretrain_main([*TINY, "--save", str(tmp_path / "sync")]) == 0
        assert pretrain_main([*TINY, "--save", str(tmp_path / "async"), "--async-save"]) == 0
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    out = capsys.readouterr().out
    for iteration in (2, 4, 6):
        assert f"saving checkpoint at iteration {iteration} in the background" in out
        assert f"saved checkpoint at iteration {iteration} to {tmp_path / 'async'}" in out
        name = f"iter_{iteration:07d}"
        sync = read_full_tensors(tmp_path / "sync" / name)
        done = read_full_tensors(tmp_path / "async" / name)
        assert sorted(sync) == sorted(done)
        assert all(torch.equal(sync[k], done[k]) for k in sync)
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    assert not list((tmp_path / "async").glob("*.tmp"))
