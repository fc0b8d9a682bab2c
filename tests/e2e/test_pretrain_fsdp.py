"""Fully sharded data parallelism (PyTorch FSDP2, parallel/fully_sharded.py) under torchrun on
CPU (Gloo): dp = 2 and 4, and tp = 2 x dp = 2, train like one process (same losses and gradient
norms, fp32); each rank holds its shard of the parameters, gradients and Adam state; a checkpoint
saved sharded resumes exactly, with FSDP or with the distributed optimizer at another dp size;
Megatron-FSDP's ZeRO-2 strategy in bf16 with per-token loss gives the one-process gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "--mock-data", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "4", "--log-interval", "1",
    "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--deterministic-mode", "--no-progress-bar",
]  # fmt: skip


def _pretrain(directory: Path, *flags: str, nproc: int = 1) -> list[dict]:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    metrics = directory / "metrics.jsonl"
    command = [*launcher, "-m", "gigatron.cli", "pretrain", "gpt", *TINY, *flags,
               "--metrics-file", str(metrics)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _train(records: list[dict], key: str = "lm_loss") -> dict[int, float]:
    return {r["iteration"]: r[key] for r in records if r["type"] == "train"}


def _bytes(records: list[dict]) -> list[dict]:
    (startup,) = [r for r in records if r["type"] == "startup"]
    return startup["bytes_per_rank"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return _pretrain(tmp_path_factory.mktemp("dp1"))


@pytest.fixture(scope="module")
def sharded_dp2(tmp_path_factory) -> tuple[Path, list[dict]]:
    directory = tmp_path_factory.mktemp("fsdp_dp2")
    flags = ["--use-torch-fsdp2", "--save", str(directory / "ckpt"), "--save-interval", "2"]
    return directory, _pretrain(directory, *flags, nproc=2)


def test_dp2_equals_one_process_and_shards_the_state(reference, sharded_dp2):
    _, records = sharded_dp2
    assert _train(records) == pytest.approx(_train(reference), rel=1e-6)
    assert _train(records, "grad_norm") == pytest.approx(_train(reference, "grad_norm"), rel=1e-5)
    (whole,) = _bytes(reference)
    for rank in _bytes(records):
        # fp32 parameters, gradients and Adam moments: each rank holds about half (dim-0
        # shards are padded to equal sizes, so a little more).
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            assert 0.45 * whole[key] <= rank[key] <= 0.56 * whole[key], (key, rank, whole)


@pytest.mark.parametrize(
    "flags",
    [
        ["--use-torch-fsdp2"],  # dp = 4
        ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ],
    ids=["dp4", "tp2_dp2"],
)
def test_four_processes_equal_one_process(reference, tmp_path, flags):
    records = _pretrain(tmp_path, *flags, nproc=4)
    assert _train(records) == pytest.approx(_train(reference), rel=1e-6)
    assert _train(records, "grad_norm") == pytest.approx(_train(reference, "grad_norm"), rel=1e-5)


def test_sharded_checkpoint_resumes_with_the_distributed_optimizer_at_dp1(
    reference, sharded_dp2, tmp_path
):
    directory, _ = sharded_dp2
    ckpt = directory / "ckpt"
    assert (ckpt / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    records = _pretrain(
        tmp_path, "--use-distributed-optimizer", "--load", str(ckpt), "--ckpt-step", "2"
    )
    expected = {i: v for i, v in _train(reference).items() if i > 2}
    assert _train(records) == pytest.approx(expected, rel=1e-6)


def test_sharded_checkpoint_resumes_sharded(reference, sharded_dp2, tmp_path):
    directory, _ = sharded_dp2
    flags = ["--use-torch-fsdp2", "--load", str(directory / "ckpt"), "--ckpt-step", "2"]
    records = _pretrain(tmp_path, *flags, nproc=2)
    expected = {i: v for i, v in _train(reference).items() if i > 2}
    assert _train(records) == pytest.approx(expected, rel=1e-6)


def test_megatron_fsdp_zero2_bf16_per_token_loss(tmp_path):
    flags = ["--bf16", "--calculate-per-token-loss"]
    one = _pretrain(tmp_path / "one", *flags)
    sharded = _pretrain(
        tmp_path / "two", *flags, "--use-megatron-fsdp", "--use-distributed-optimizer",
        "--data-parallel-sharding-strategy", "optim_grads", nproc=2,
    )  # fmt: skip
    # Summed (not averaged) over dp: the per-token gradient norms are the one-process ones.
    assert _train(sharded, "grad_norm") == pytest.approx(_train(one, "grad_norm"), rel=1e-3)
    assert _train(sharded) == pytest.approx(_train(one), rel=1e-4)
