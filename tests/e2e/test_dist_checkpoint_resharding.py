"""`--ckpt-format torch_dist` resharding through `gigatron pretrain` under torchrun (Gloo).

A dense GPT trained at (tp 2, pp 2, dp 2, distributed optimizer) saves at iterations 2 and 4; the
checkpoint of iteration 2 is then loaded at other layouts (tp 1, tp 4, pp 4, tp 2 x dp 4 with the
distributed optimizer, pp 2 with 2 virtual stages, tp 2 x cp 2) and training resumes: iterations 3
and 4 must give the saved run's losses. Converting on load (`--ckpt-convert-format torch_dist`)
at another layout must store bit for bit the same tensors, model and optimizer state. An MoE model
saved at (tp 2, ep 2) reshards to ep 1 and ep 4 the same way.

The runs are grouped by process count: one launch per count runs its configurations in turn in
one process group (tests/gigatron_sequence.py); each test checks its run's results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.dist_format import read_full_tensors
from helpers import gigatron_runs, tiny_gpt_flags, train_values

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


def command(*flags: str) -> list[str]:
    return ["pretrain", "gpt", *DENSE, *flags]


def losses(directory: Path) -> dict[int, float]:
    return train_values(directory)


def assert_same_tensors(a: Path, b: Path) -> None:
    saved, converted = read_full_tensors(a), read_full_tensors(b)
    assert sorted(saved) == sorted(converted)
    assert any(key.startswith("optimizer.exp_avg_sq.") for key in saved)
    for key, value in saved.items():
        assert torch.equal(value, converted[key]), key


def _runs(dense: Path, moe: Path) -> dict[str, tuple[int, list[str]]]:
    """Every run of this file: name -> (processes, command). One launch per process count runs
    its commands in order (process start-up dominates on CPU), savers before their loaders."""
    from_dense = ["--load", str(dense / "saved"), "--ckpt-step", "2"]
    from_moe = ["--load", str(moe / "saved"), "--ckpt-step", "2"]
    convert = ["--ckpt-convert-format", "torch_dist", "--ckpt-convert-save"]
    runs = {
        "dense/saved": (8, command(*SAVED_LAYOUT, "--save", str(dense / "saved"),
                                   "--save-interval", "2")),
        "dense/one": (1, command("--save", str(dense / "one"))),
        "moe/saved": (4, command(*MOE, TP, "2", "--expert-model-parallel-size", "2",
                                 "--sequence-parallel", "--use-distributed-optimizer",
                                 "--save", str(moe / "saved"), "--save-interval", "2")),
        # the ep 1 run saves its own torch_dist checkpoint at iteration 4; converting the
        # (tp 2, ep 2) one to ep 1 on load must store the same tensors as the source
        "moe/converted_ep1": (1, command(*MOE, *from_moe, *convert, str(moe / "converted_ep1"))),
    }  # fmt: skip
    for layout, (flags, nproc) in LAYOUTS.items():
        out = dense / f"resumed_{layout}"
        runs[f"dense/resumed_{layout}"] = (nproc, command(*flags, *from_dense, "--save", str(out)))
    for layout in CONVERTED:
        flags, nproc = LAYOUTS[layout]
        out = str(dense / f"converted_{layout}")
        runs[f"dense/converted_{layout}"] = (nproc, command(*flags, *from_dense, *convert, out))
    for layout, (flags, nproc) in MOE_LAYOUTS.items():
        out = moe / f"resumed_{layout}"
        runs[f"moe/resumed_{layout}"] = (
            nproc,
            command(*MOE, *flags, *from_moe, "--save", str(out)),
        )
    return runs


CONVERTED = ["tp1", "tp2_dp4_distopt"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(dense root, MoE root, standard output of each run); the runs go largest launch first,
    so each checkpoint is saved before a smaller launch loads it."""
    root = tmp_path_factory.mktemp("resharding")
    dense, moe = root / "dense", root / "moe"
    dense.mkdir()
    moe.mkdir()
    stdout = gigatron_runs(root, _runs(dense, moe))
    return dense, moe, stdout


@pytest.fixture(scope="module")
def dense(outputs) -> Path:
    return outputs[0]


@pytest.fixture(scope="module")
def moe(outputs) -> Path:
    return outputs[1]


def test_saved_layout_trains_like_one_process(dense):
    # (tp 2, pp 2, dp 2, distributed optimizer) is the one-process run: the reference the
    # resumed runs are held to is itself right.
    saved, one = losses(dense / "saved"), losses(dense / "one")
    assert [saved[i] for i in range(1, 5)] == pytest.approx([one[i] for i in range(1, 5)], rel=1e-5)
    iteration = dense / "saved" / "iter_0000002"
    assert (iteration / "metadata.json").is_file() and (iteration / ".metadata").is_file()
    assert len(list(iteration.glob("*.distcp"))) == 8


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_at_another_layout(outputs, dense, layout):
    stdout = outputs[2][f"dense/resumed_{layout}"]
    assert "loaded checkpoint" in stdout and "at iteration 2" in stdout
    saved, resumed = losses(dense / "saved"), losses(dense / f"resumed_{layout}")
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == pytest.approx([saved[3], saved[4]], rel=1e-5)


@pytest.mark.parametrize("layout", CONVERTED)
def test_convert_on_load_stores_the_same_tensors(outputs, dense, layout):
    out = dense / f"converted_{layout}"
    assert "converted checkpoint" in outputs[2][f"dense/converted_{layout}"]
    assert not (out / "metrics.jsonl").exists()  # no training step ran
    assert_same_tensors(dense / "saved" / "iter_0000002", out / "iter_0000002")


@pytest.mark.parametrize("layout", sorted(MOE_LAYOUTS))
def test_moe_resumes_at_another_expert_layout(moe, layout):
    saved, resumed = losses(moe / "saved"), losses(moe / f"resumed_{layout}")
    assert [resumed[3], resumed[4]] == pytest.approx([saved[3], saved[4]], rel=1e-5)
    if layout == "ep1":
        # the (tp 2, ep 2) checkpoint converted to ep 1 on load stores the source's tensors
        converted = moe / "converted_ep1"
        assert_same_tensors(moe / "saved" / "iter_0000002", converted / "iter_0000002")
