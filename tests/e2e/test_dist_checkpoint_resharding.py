"""`--ckpt-format torch_dist` resharding through `gigatron pretrain` under torchrun (Gloo).

A dense GPT trained at (tp 2, pp 2, dp 2, distributed optimizer) saves at iterations 2 and 4; the
checkpoint of iteration 2 is then loaded at other layouts (tp 1, tp 4, pp 4, tp 2 x dp 4 with the
distributed optimizer, pp 2 with 2 virtual stages, tp 2 x cp 2) and training resumes: iterations 3
and 4 must give the saved run's losses. Converting on load (`--ckpt-convert-format torch_dist`)
at another layout must store bit for bit the same tensors, model and optimizer state. An MoE model
saved at (tp 2, ep 2) reshards to ep 1 and ep 4 the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.dist_format import read_full_tensors
from helpers import pretrain as run_pretrain
from helpers import tiny_gpt_flags, train_values

DENSE = [
    *tiny_gpt_flags(num_layers=4, hidden_size=32, micro_batch_size=1),
    "--make-vocab-size-divisible-by", "32", "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--deterministic-mode", "--hidden-dropout", "0", "--attention-dropout", "0", "--ckpt-format",
    "torch_dist",
]  # fmt: skip
SAVED_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--use-distributed-optimizer"]  # fmt: skip
TP = "--tensor-model-parallel-size"
LAYOUTS = {
    "tp1": ([], 1),
    "tp4": ([TP, "4"], 4),
    "pp4": (["--pipeline-model-parallel-size", "4"], 4),
    "tp2_dp4_distopt": ([TP, "2", "--use-distributed-optimizer"], 8),
    "pp2_vpp2": (
        ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
        2,
    ),  # fmt: skip
    "tp2_cp2": ([TP, "2", "--context-parallel-size", "2"], 4),
}
MOE = [
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-layer-freq", "[1,0,1,0]", "--moe-router-enable-expert-bias",
    "--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "0.01",
    "--moe-token-dispatcher-type", "alltoall",
]  # fmt: skip
MOE_LAYOUTS = {
    "ep1": ([], 1),
    "ep4_distopt": (["--expert-model-parallel-size", "4", "--use-distributed-optimizer"], 4),
}


def pretrain(nproc: int, *flags: str) -> str:
    return run_pretrain("gpt", *DENSE, *flags, nproc=nproc).stdout


def losses(directory: Path) -> dict[int, float]:
    return train_values(directory)


def assert_same_tensors(a: Path, b: Path) -> None:
    saved, converted = read_full_tensors(a), read_full_tensors(b)
    assert sorted(saved) == sorted(converted)
    assert any(key.startswith("optimizer.exp_avg_sq.") for key in saved)
    for key, value in saved.items():
        assert torch.equal(value, converted[key]), key


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dense")
    pretrain(8, *SAVED_LAYOUT, "--save", str(root / "saved"), "--save-interval", "2")
    return root


def test_saved_layout_trains_like_one_process(dense):
    # (tp 2, pp 2, dp 2, distributed optimizer) is the one-process run: the reference the
    # resumed runs are held to is itself right.
    pretrain(1, "--save", str(dense / "one"))
    saved, one = losses(dense / "saved"), losses(dense / "one")
    assert [saved[i] for i in range(1, 5)] == pytest.approx([one[i] for i in range(1, 5)], rel=1e-5)
    iteration = dense / "saved" / "iter_0000002"
    assert (iteration / "metadata.json").is_file() and (iteration / ".metadata").is_file()
    assert len(list(iteration.glob("*.distcp"))) == 8


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_at_another_layout(dense, layout):
    flags, nproc = LAYOUTS[layout]
    out = dense / f"resumed_{layout}"
    stdout = pretrain(nproc, *flags, "--load", str(dense / "saved"), "--ckpt-step", "2",
                      "--save", str(out))  # fmt: skip
    assert "loaded checkpoint" in stdout and "at iteration 2" in stdout
    saved, resumed = losses(dense / "saved"), losses(out)
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == pytest.approx([saved[3], saved[4]], rel=1e-5)


@pytest.mark.parametrize("layout", ["tp1", "tp2_dp4_distopt"])
def test_convert_on_load_stores_the_same_tensors(dense, layout):
    flags, nproc = LAYOUTS[layout]
    out = dense / f"converted_{layout}"
    stdout = pretrain(nproc, *flags, "--load", str(dense / "saved"), "--ckpt-step", "2",
                      "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", str(out))  # fmt: skip
    assert "converted checkpoint" in stdout
    assert not (out / "metrics.jsonl").exists()  # no training step ran
    assert_same_tensors(dense / "saved" / "iter_0000002", out / "iter_0000002")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    pretrain(4, *MOE, TP, "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
             "--use-distributed-optimizer", "--save", str(root / "saved"), "--save-interval", "2")  # fmt: skip
    return root


@pytest.mark.parametrize("layout", sorted(MOE_LAYOUTS))
def test_moe_resumes_at_another_expert_layout(moe, layout):
    flags, nproc = MOE_LAYOUTS[layout]
    out = moe / f"resumed_{layout}"
    pretrain(nproc, *MOE, *flags, "--load", str(moe / "saved"), "--ckpt-step", "2",
             "--save", str(out))  # fmt: skip
    saved, resumed = losses(moe / "saved"), losses(out)
    assert [resumed[3], resumed[4]] == pytest.approx([saved[3], saved[4]], rel=1e-5)
    if layout == "ep1":
        # the ep 1 run saved its own torch_dist checkpoint at iteration 4; converting the
        # (tp 2, ep 2) one to ep 1 on load stores the same tensors as the source
        converted = moe / "converted_ep1"
        pretrain(1, *MOE, "--load", str(moe / "saved"), "--ckpt-step", "2",
                 "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", str(converted))  # fmt: skip
        assert_same_tensors(moe / "saved" / "iter_0000002", converted / "iter_0000002")
