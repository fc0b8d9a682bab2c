"""Fully sharded data parallelism (PyTorch FSDP2, parallel/fully_sharded.py) under torchrun on
CPU (Gloo): dp = 2 and 4, and tp = 2 x dp = 2, train like one process (same losses and gradient
norms, fp32); each rank holds its shard of the parameters, gradients and Adam state; a checkpoint
saved sharded resumes exactly, with FSDP or with the distributed optimizer at another dp size;
Megatron-FSDP's ZeRO-2 strategy in bf16 with per-token loss gives the one-process gradients;
--ckpt-format torch_dist checkpoints move between FSDP and the distributed optimizer both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import pretrain, tiny_gpt_flags, train_values
from helpers import records as read_records

TINY = [
    *tiny_gpt_flags(vocab_size=256, seq_length=32), "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
    "--no-progress-bar",
]  # fmt: skip


def _pretrain(directory: Path, *flags: str, nproc: int = 1) -> list[dict]:
    metrics = directory / "metrics.jsonl"
    pretrain("gpt", *TINY, *flags, "--metrics-file", str(metrics), nproc=nproc)
    if not metrics.is_file():  # a convert-on-load run stops before training
        return []
    return read_records(metrics)


def _train(records: list[dict], key: str = "lm_loss") -> dict[int, float]:
    return train_values(records, key)


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


# ---- --ckpt-format torch_dist: each rank writes its shards, any layout reads them ----------------
DIST = ["--ckpt-format", "torch_dist"]


def _saving(directory: Path, *flags: str, nproc: int) -> tuple[Path, list[dict]]:
    ckpt = directory / "ckpt"
    records = _pretrain(directory, *DIST, *flags, "--save", str(ckpt), "--save-interval", "2",
                        nproc=nproc)  # fmt: skip
    return ckpt, records


def _resumed(directory: Path, ckpt: Path, *flags: str, nproc: int) -> dict[int, float]:
    flags = (*DIST, *flags, "--load", str(ckpt), "--ckpt-step", "2")
    return _train(_pretrain(directory, *flags, nproc=nproc))


def _after_2(records: list[dict]) -> dict[int, float]:
    return {i: v for i, v in _train(records).items() if i > 2}


@pytest.fixture(scope="module")
def sharded_dist_dp2(tmp_path_factory) -> Path:
    ckpt, records = _saving(tmp_path_factory.mktemp("fsdp_dist"), "--use-torch-fsdp2", nproc=2)
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()
    return ckpt


@pytest.mark.parametrize(
    "flags,nproc",
    [
        (["--use-torch-fsdp2"], 2),
        (["--use-distributed-optimizer"], 1),
        (["--use-distributed-optimizer", "--tensor-model-parallel-size", "2"], 2),
    ],
    ids=["fsdp_dp2", "distopt_dp1", "distopt_tp2"],
)
def test_torch_dist_from_fsdp_resumes(reference, sharded_dist_dp2, tmp_path, flags, nproc):
    resumed = _resumed(tmp_path, sharded_dist_dp2, *flags, nproc=nproc)
    assert resumed == pytest.approx(_after_2(reference), rel=1e-5)


def test_torch_dist_from_the_distributed_optimizer_loads_into_fsdp(reference, tmp_path):
    ckpt, _ = _saving(tmp_path / "dp1", "--use-distributed-optimizer", nproc=1)
    resumed = _resumed(tmp_path / "fsdp", ckpt, "--use-torch-fsdp2", nproc=2)
    assert resumed == pytest.approx(_after_2(reference), rel=1e-5)


def test_torch_dist_bf16_fsdp_stores_the_distributed_optimizer_names(tmp_path):
    """Under --bf16, FSDP's fp32 shards are stored as a distributed-optimizer run stores its
    weights: `model.*` in bf16 and `optimizer.fp32_param.*` in fp32; each loads the other's."""
    from gigatron.checkpoint.dist_format import read_full_tensors

    fsdp_ckpt, fsdp = _saving(tmp_path / "fsdp", "--bf16", "--use-torch-fsdp2", nproc=2)
    dist_ckpt, distopt = _saving(tmp_path / "dist", "--bf16", "--use-distributed-optimizer",
                                 nproc=1)  # fmt: skip
    a = read_full_tensors(fsdp_ckpt / "iter_0000002")
    b = read_full_tensors(dist_ckpt / "iter_0000002")
    assert sorted(a) == sorted(b)
    assert any(key.startswith("optimizer.fp32_param.") for key in a)
    for key, tensor in a.items():
        assert (tensor.dtype, tensor.shape) == (b[key].dtype, b[key].shape), key
        if key.startswith("model.") and tensor.is_floating_point():
            assert tensor.dtype == torch.bfloat16, key
        main = a.get(key.replace("model.", "optimizer.fp32_param.", 1))
        if key.startswith("model.") and main is not None:
            assert torch.equal(tensor, main.to(torch.bfloat16)), key
    # Resumed across the two, each gives the losses of the run that saved it (bf16 resume is
    # exact for the same layout, within bf16's reduction-order noise across layouts).
    to_dist = _resumed(tmp_path / "a", fsdp_ckpt, "--bf16", "--use-distributed-optimizer", nproc=1)
    assert to_dist == pytest.approx(_after_2(fsdp), rel=1e-5)
    to_fsdp = _resumed(tmp_path / "b", dist_ckpt, "--bf16", "--use-torch-fsdp2", nproc=2)
    assert to_fsdp == pytest.approx(_after_2(distopt), rel=1e-3)
    again = _resumed(tmp_path / "c", fsdp_ckpt, "--bf16", "--use-torch-fsdp2", nproc=2)
    assert again == pytest.approx(_after_2(fsdp), rel=1e-6)


def test_fsdp_converts_torch_dist_to_torch_on_load(reference, sharded_dist_dp2, tmp_path):
    """Convert-on-load under FSDP gathers the full weights for the torch format's writers."""
    converted = tmp_path / "converted"
    _pretrain(tmp_path / "convert", *DIST, "--use-torch-fsdp2", "--load", str(sharded_dist_dp2),
              "--ckpt-step", "2", "--ckpt-convert-format", "torch",
              "--ckpt-convert-save", str(converted), nproc=2)  # fmt: skip
    assert (converted / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    flags = ["--use-distributed-optimizer", "--load", str(converted)]
    resumed = _train(_pretrain(tmp_path / "resume", *flags))
    assert resumed == pytest.approx(_after_2(reference), rel=1e-5)
