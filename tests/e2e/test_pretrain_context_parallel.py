"""`gigatron pretrain gpt --context-parallel-size N` end to end (GPT with RoPE + GQA, 10
iterations): cp 2 and cp 2 composed with tensor + sequence, pipeline and data parallelism under the
distributed optimizer give the one-process losses and gradient norms; a checkpoint saved at cp 2
resumes at cp 2 bit-exactly and loads at cp 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import pretrain, records, tiny_gpt_flags

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FLAGS = [
    *tiny_gpt_flags(num_attention_heads=8, seq_length=32), "--make-vocab-size-divisible-by", "32",
    "--group-query-attention", "--num-query-groups", "4", "--position-embedding-type", "rope",
    "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "10", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
    "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


def _train(directory: Path, *flags: str, nproc: int = 1) -> Path:
    pretrain("gpt", *FLAGS, *flags, "--save", str(directory), nproc=nproc)
    return directory


def _train_records(directory: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in records(directory, "train")}


def _assert_same_run(got: dict[int, dict], expected: dict[int, dict], rel: float) -> None:
    assert sorted(got) == sorted(expected)
    for key in ("lm_loss", "grad_norm"):
        values = [got[i][key] for i in sorted(got)]
        assert values == pytest.approx([expected[i][key] for i in sorted(got)], rel=rel), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    return _train_records(_train(tmp_path_factory.mktemp("cp1")))


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory) -> Path:
    """cp 2 (ring attention), saving at iterations 5 and 10."""
    return _train(
        tmp_path_factory.mktemp("cp2"), "--context-parallel-size", "2", "--save-interval", "5",
        nproc=2,
    )  # fmt: skip


def test_cp2_matches_one_process(reference, cp2_run):
    _assert_same_run(_train_records(cp2_run), reference, rel=1e-5)


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--cp-comm-type", "p2p"],
        ["--pipeline-model-parallel-size", "2", "--cp-comm-type", "a2a"],
        ["--cp-comm-type", "allgather"],  # 4 processes: dp 2 x cp 2
    ],
    ids=["tp2xcp2-p2p", "pp2xcp2-a2a", "dp2xcp2-allgather"],
)
def test_composed_layouts_with_distributed_optimizer_match(reference, tmp_path, layout):
    flags = ["--context-parallel-size", "2", "--use-distributed-optimizer", *layout]
    _assert_same_run(_train_records(_train(tmp_path, *flags, nproc=4)), reference, rel=1e-5)


def test_checkpoint_resumes_at_cp2_exactly_and_loads_at_cp1(cp2_run, tmp_path):
    uninterrupted = _train_records(cp2_run)
    later = {i: uninterrupted[i] for i in range(6, 11)}
    load = ["--load", str(cp2_run), "--ckpt-step", "5"]
    resumed = _train_records(
        _train(tmp_path / "cp2", "--context-parallel-size", "2", *load, nproc=2)
    )
    assert {i: (r["lm_loss"], r["grad_norm"]) for i, r in resumed.items()} == {
        i: (r["lm_loss"], r["grad_norm"]) for i, r in later.items()
    }
    _assert_same_run(_train_records(_train(tmp_path / "cp1", *load)), later, rel=1e-5)
