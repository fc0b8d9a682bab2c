"""Fully sharded data parallelism (PyTorch FSDP2, parallel/fully_sharded.py) under torchrun on
CPU (Gloo): dp = 2 and 4, and tp = 2 x dp = 2, train like one process (same losses and gradient
norms, fp32); each rank holds its shard of the parameters, gradients and Adam state; a checkpoint
saved sharded resumes exactly, with FSDP or with the distributed optimizer at another dp size;
Megatron-FSDP's ZeRO-2 strategy in bf16 with per-token loss gives the one-process gradients;
--ckpt-format torch_dist checkpoints move between FSDP and the distributed optimizer both ways.

Every run is named in RUNS; the fixture `runs` starts them in a few launches (one per phase and
process count, each running its configurations in turn in one process group through
tests/gigatron_sequence.py) and each test checks the records of its runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import gigatron_runs, tiny_gpt_flags, train_values
from helpers import records as read_records

TINY = [
    *tiny_gpt_flags(vocab_size=256, seq_length=32), "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
    "--no-progress-bar",
]  # fmt: skip


DIST = ["--ckpt-format", "torch_dist"]
FSDP = ["--use-torch-fsdp2"]
DISTOPT = ["--use-distributed-optimizer"]
PER_TOKEN_BF16 = ["--bf16", "--calculate-per-token-loss"]


def _save(name: str) -> list[str]:
    return ["--save", f"{{root}}/{name}/ckpt", "--save-interval", "2"]


def _load(name: str) -> list[str]:
    return ["--load", f"{{root}}/{name}/ckpt", "--ckpt-step", "2"]


# name -> (phase, processes, flags); `{root}` is the runs' folder. A phase starts after the
# runs of the phases before it (its checkpoints' savers) have ended.
RUNS: dict[str, tuple[int, int, list[str]]] = {
    "dp1": (0, 1, []),
    "fsdp_dp2": (0, 2, [*FSDP, *_save("fsdp_dp2")]),
    "dp4": (0, 4, FSDP),
    "tp2_dp2": (0, 4, [*FSDP, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "resumed_distopt_dp1": (1, 1, [*DISTOPT, *_load("fsdp_dp2")]),
    "resumed_sharded": (1, 2, [*FSDP, *_load("fsdp_dp2")]),
    "mfsdp_one": (0, 1, PER_TOKEN_BF16),
    "mfsdp_two": (0, 2, [*PER_TOKEN_BF16, "--use-megatron-fsdp", *DISTOPT,
                         "--data-parallel-sharding-strategy", "optim_grads"]),
    # ---- --ckpt-format torch_dist: each rank writes its shards, any layout reads them ----
    "dist_fsdp": (0, 2, [*DIST, *FSDP, *_save("dist_fsdp")]),
    "from_fsdp_fsdp_dp2": (1, 2, [*DIST, *FSDP, *_load("dist_fsdp")]),
    "from_fsdp_distopt_dp1": (1, 1, [*DIST, *DISTOPT, *_load("dist_fsdp")]),
    "from_fsdp_distopt_tp2": (1, 2, [*DIST, *DISTOPT, "--tensor-model-parallel-size", "2",
                                     *_load("dist_fsdp")]),
    "dist_dp1": (0, 1, [*DIST, *DISTOPT, *_save("dist_dp1")]),
    "into_fsdp": (1, 2, [*DIST, *FSDP, *_load("dist_dp1")]),
    "bf16_fsdp": (0, 2, [*DIST, "--bf16", *FSDP, *_save("bf16_fsdp")]),
    "bf16_dist": (0, 1, [*DIST, "--bf16", *DISTOPT, *_save("bf16_dist")]),
    "bf16_fsdp_to_dist": (1, 1, [*DIST, "--bf16", *DISTOPT, *_load("bf16_fsdp")]),
    "bf16_dist_to_fsdp": (1, 2, [*DIST, "--bf16", *FSDP, *_load("bf16_dist")]),
    "bf16_fsdp_again": (1, 2, [*DIST, "--bf16", *FSDP, *_load("bf16_fsdp")]),
    "convert": (1, 2, [*DIST, *FSDP, *_load("dist_fsdp"), "--ckpt-convert-format", "torch",
                       "--ckpt-convert-save", "{root}/convert/converted"]),
    "convert_resumed": (2, 1, [*DISTOPT, "--load", "{root}/convert/converted"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The folder of every run in RUNS (`<name>/metrics.jsonl`, `<name>/ckpt`)."""
    root = tmp_path_factory.mktemp("fsdp")
    for phase in sorted({phase for phase, _, _ in RUNS.values()}):
        runs = {}
        for name, (_, nproc, flags) in ((n, r) for n, r in RUNS.items() if r[0] == phase):
            (root / name).mkdir()
            metrics = ["--metrics-file", str(root / name / "metrics.jsonl")]
            argv = [f.format(root=root) for f in flags]
            runs[name] = (nproc, ["pretrain", "gpt", *TINY, *argv, *metrics])
        gigatron_runs(root, runs)
    return root


def _records(runs: Path, name: str) -> list[dict]:
    metrics = runs / name / "metrics.jsonl"
    if not metrics.is_file():  # a convert-on-load run stops before training
        return []
    return read_records(metrics)


def _train(records: list[dict], key: str = "lm_loss") -> dict[int, float]:
    return train_values(records, key)


def _bytes(records: list[dict]) -> list[dict]:
    (startup,) = [r for r in records if r["type"] == "startup"]
    return startup["bytes_per_rank"]


def _after_2(records: list[dict]) -> dict[int, float]:
    return {i: v for i, v in _train(records).items() if i > 2}


@pytest.fixture(scope="module")
def reference(runs) -> list[dict]:
    return _records(runs, "dp1")


def test_dp2_equals_one_process_and_shards_the_state(runs, reference):
    records = _records(runs, "fsdp_dp2")
    assert _train(records) == pytest.approx(_train(reference), rel=1e-6)
    assert _train(records, "grad_norm") == pytest.approx(_train(reference, "grad_norm"), rel=1e-5)
    (whole,) = _bytes(reference)
    for rank in _bytes(records):
        # fp32 parameters, gradients and Adam moments: each rank holds about half (dim-0
        # shards are padded to equal sizes, so a little more).
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            assert 0.45 * whole[key] <= rank[key] <= 0.56 * whole[key], (key, rank, whole)


@pytest.mark.parametrize("name", ["dp4", "tp2_dp2"])
def test_four_processes_equal_one_process(runs, reference, name):
    records = _records(runs, name)
    assert _train(records) == pytest.approx(_train(reference), rel=1e-6)
    assert _train(records, "grad_norm") == pytest.approx(_train(reference, "grad_norm"), rel=1e-5)


def test_sharded_checkpoint_resumes_with_the_distributed_optimizer_at_dp1(runs, reference):
    ckpt = runs / "fsdp_dp2" / "ckpt"
    assert (ckpt / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    records = _records(runs, "resumed_distopt_dp1")
    assert _train(records) == pytest.approx(_after_2(reference), rel=1e-6)


def test_sharded_checkpoint_resumes_sharded(runs, reference):
    records = _records(runs, "resumed_sharded")
    assert _train(records) == pytest.approx(_after_2(reference), rel=1e-6)


def test_megatron_fsdp_zero2_bf16_per_token_loss(runs):
    one, sharded = _records(runs, "mfsdp_one"), _records(runs, "mfsdp_two")
    # Summed (not averaged) over dp: the per-token gradient norms are the one-process ones.
    assert _train(sharded, "grad_norm") == pytest.approx(_train(one, "grad_norm"), rel=1e-3)
    assert _train(sharded) == pytest.approx(_train(one), rel=1e-4)


@pytest.mark.parametrize("layout", ["fsdp_dp2", "distopt_dp1", "distopt_tp2"])
def test_torch_dist_from_fsdp_resumes(runs, reference, layout):
    assert (runs / "dist_fsdp" / "ckpt" / "iter_0000002" / "metadata.json").is_file()
    resumed = _train(_records(runs, f"from_fsdp_{layout}"))
    assert resumed == pytest.approx(_after_2(reference), rel=1e-5)


def test_torch_dist_from_the_distributed_optimizer_loads_into_fsdp(runs, reference):
    resumed = _train(_records(runs, "into_fsdp"))
    assert resumed == pytest.approx(_after_2(reference), rel=1e-5)


def test_torch_dist_bf16_fsdp_stores_the_distributed_optimizer_names(runs):
    """Under --bf16, FSDP's fp32 shards are stored as a distributed-optimizer run stores its
    weights: `model.*` in bf16 and `optimizer.fp32_param.*` in fp32; each loads the other's."""
    from gigatron.checkpoint.dist_format import read_full_tensors

    fsdp, distopt = _records(runs, "bf16_fsdp"), _records(runs, "bf16_dist")
    a = read_full_tensors(runs / "bf16_fsdp" / "ckpt" / "iter_0000002")
    b = read_full_tensors(runs / "bf16_dist" / "ckpt" / "iter_0000002")
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
    to_dist = _train(_records(runs, "bf16_fsdp_to_dist"))
    assert to_dist == pytest.approx(_after_2(fsdp), rel=1e-5)
    to_fsdp = _train(_records(runs, "bf16_dist_to_fsdp"))
    assert to_fsdp == pytest.approx(_after_2(distopt), rel=1e-3)
    again = _train(_records(runs, "bf16_fsdp_again"))
    assert again == pytest.approx(_after_2(fsdp), rel=1e-6)


def test_fsdp_converts_torch_dist_to_torch_on_load(runs, reference):
    """Convert-on-load under FSDP gathers the full weights for the torch format's writers."""
    converted = runs / "convert" / "converted"
    assert (converted / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    resumed = _train(_records(runs, "convert_resumed"))
    assert resumed == pytest.approx(_after_2(reference), rel=1e-5)
