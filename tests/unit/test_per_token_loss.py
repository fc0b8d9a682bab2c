"""--calculate-per-token-loss: losses are summed over tokens and the gradients divided once by the
global batch's token count, so with equal token counts per micro-batch training is the same as
with per-micro-batch means (plain SGD shows any scale difference directly)."""

from __future__ import annotations

import io

import pytest

from gigatron.training.pretrain import parse_pretrain_config, pretrain
from helpers import tiny_gpt_flags

FLAGS = [
    *tiny_gpt_flags(vocab_size=64, hidden_size=32), "--global-batch-size", "8", "--optimizer",
    "sgd", "--lr", "0.5", "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode", "--num-workers",
    "0",
]  # fmt: skip


def _train(tmp_path, *extra: str):
    metrics = ["--metrics-file", str(tmp_path / f"metrics{len(list(tmp_path.iterdir()))}.jsonl")]
    cfg = parse_pretrain_config([*FLAGS, *extra, *metrics], world_size=1)
    result, _ = pretrain(cfg, stream=io.StringIO())
    return result


def test_per_token_loss_divides_the_gradients_by_the_global_token_count(tmp_path):
    means = _train(tmp_path)
    per_token = _train(tmp_path, "--calculate-per-token-loss")
    assert list(per_token.train_losses) == [1, 2, 3, 4]
    for iteration, loss in means.train_losses.items():
        assert per_token.train_losses[iteration] == pytest.approx(loss, rel=1e-5)
    # The step size shows in the losses: half the learning rate gives other ones.
    half = _train(tmp_path, "--calculate-per-token-loss", "--lr", "0.25")
    assert half.train_losses[4] != pytest.approx(per_token.train_losses[4], rel=1e-4)
