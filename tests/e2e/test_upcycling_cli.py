"""`gigatron pretrain gpt --moe-use-upcycling`: a dense run's checkpoint becomes an MoE run whose
first loss (step-0 weights, first batch) equals the dense model fine-tuned from the same
checkpoint on the same batch (one launch, three commands)."""

from __future__ import annotations

from helpers import gigatron_runs, tiny_gpt_flags, train_values

FLAGS = [
    *tiny_gpt_flags(), "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
    "--swiglu", "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2",
    "--eval-iters", "0", "--num-workers", "0",
]  # fmt: skip


def test_upcycled_run_starts_from_the_dense_model(tmp_path):
    dense, moe, tuned = (tmp_path / name for name in ("dense", "moe", "tuned"))
    outputs = gigatron_runs(tmp_path, {
        "dense": (1, ["pretrain", "gpt", *FLAGS, "--save", str(dense)]),
        "moe": (1, ["pretrain", "gpt", *FLAGS, "--num-experts", "4", "--moe-router-topk", "2",
                    "--moe-use-upcycling", "--load", str(dense), "--save", str(moe)]),
        "tuned": (1, ["pretrain", "gpt", *FLAGS, "--load", str(dense), "--finetune",
                      "--save", str(tuned)]),
    })  # fmt: skip
    assert "upcycled the dense checkpoint" in outputs["moe"]
    first_moe, first_dense = train_values(moe)[1], train_values(tuned)[1]
    assert abs(first_moe - first_dense) < 1e-5 * first_dense
    assert train_values(moe)[2] != train_values(tuned)[2]  # then they train differently
