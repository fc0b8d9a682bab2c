"""`gigatron pretrain --finetune --load DIR`: continued pretraining loads the weights only; the
iteration count, consumed samples and learning-rate schedule start again (optimizer state reset:
tests/unit/test_checkpoint.py::test_release_and_finetune_load_weights_only)."""

from __future__ import annotations

import json

import pytest
import torch

from gigatron.training.pretrain import main as pretrain_main
from helpers import tiny_gpt_flags

TINY = [
    "gpt", *tiny_gpt_flags(hidden_size=32), "--global-batch-size", "4", "--lr", "1e-3",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--no-progress-bar",
]  # fmt: skip


def _train_records(directory):
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "train"]


@pytest.fixture
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_finetune_loads_weights_and_restarts_iterations_and_schedule(tmp_path, single_thread):
    base, tuned, fresh = tmp_path / "base", tmp_path / "tuned", tmp_path / "fresh"
    assert pretrain_main([*TINY, "--train-iters", "6", "--save", str(base)]) == 0
    assert pretrain_main([*TINY, "--train-iters", "4", "--save", str(fresh)]) == 0
    flags = ["--train-iters", "4", "--save", str(tuned), "--load", str(base), "--finetune"]
    assert pretrain_main([*TINY, *flags]) == 0
    records, reference = _train_records(tuned), _train_records(fresh)
    # Iterations, samples and the learning-rate schedule start again.
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert [r["consumed_samples"] for r in records] == [4, 8, 12, 16]
    assert [r["lr"] for r in records] == [r["lr"] for r in reference]
    assert records[0]["lr"] == pytest.approx(1e-3 * 3 / 4)
    # The weights are the trained ones: the same first batch has a lower loss than from scratch.
    assert records[0]["lm_loss"] < reference[0]["lm_loss"] - 0.01
    assert (tuned / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
