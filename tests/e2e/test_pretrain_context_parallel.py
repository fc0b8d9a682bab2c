"""`gigatron pretrain gpt --context-parallel-size N` end to end (GPT with RoPE + GQA, 10
iterations): cp 2 and cp 2 composed with tensor + sequence, pipeline and data parallelism under the
distributed optimizer give the one-process losses and gradient norms; a checkpoint saved at cp 2
resumes at cp 2 bit-exactly and loads at cp 1. The runs go in one launch per process count
(`runs`, helpers.gigatron_runs); each test checks its runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import gigatron_runs, records, tiny_gpt_flags

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FLAGS = [
    *tiny_gpt_flags(num_attention_heads=8, seq_length=32), "--make-vocab-size-divisible-by", "32",
    "--group-query-attention", "--num-query-groups", "4", "--position-embedding-type", "rope",
    "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "10", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
    "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


def _train_records(directory: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in records(directory, "train")}


def _assert_same_run(got: dict[int, dict], expected: dict[int, dict], rel: float) -> None:
    assert sorted(got) == sorted(expected)
    for key in ("lm_loss", "grad_norm"):
        values = [got[i][key] for i in sorted(got)]
        assert values == pytest.approx([expected[i][key] for i in sorted(got)], rel=rel), key


COMPOSED = {
    "tp2xcp2-p2p": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                    "--cp-comm-type", "p2p"],
    "pp2xcp2-a2a": ["--pipeline-model-parallel-size", "2", "--cp-comm-type", "a2a"],
    "dp2xcp2-allgather": ["--cp-comm-type", "allgather"],  # 4 processes: dp 2 x cp 2
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run of this file in one launch per process count (largest first, so the cp 2
    checkpoint exists before the cp 2 resume after it and the cp 1 load); `<root>/<name>`."""
    root = tmp_path_factory.mktemp("cp")

    def command(name: str, *flags: str) -> list[str]:
        return ["pretrain", "gpt", *FLAGS, *flags, "--save", str(root / name)]

    load = ["--load", str(root / "cp2"), "--ckpt-step", "5"]
    runs = {
        # cp 2 (ring attention), saving at iterations 5 and 10
        "cp2": (2, command("cp2", "--context-parallel-size", "2", "--save-interval", "5")),
        "cp2_resumed": (2, command("cp2_resumed", "--context-parallel-size", "2", *load)),
        "cp1": (1, command("cp1")),
        "cp1_loaded": (1, command("cp1_loaded", *load)),
    }
    for name, layout in COMPOSED.items():
        flags = ["--context-parallel-size", "2", "--use-distributed-optimizer", *layout]
        runs[name] = (4, command(name, *flags))
    gigatron_runs(root, runs)
    return root


@pytest.fixture(scope="module")
def reference(runs) -> dict[int, dict]:
    return _train_records(runs / "cp1")


def test_cp2_matches_one_process(runs, reference):
    _assert_same_run(_train_records(runs / "cp2"), reference, rel=1e-5)


@pytest.mark.parametrize("layout", list(COMPOSED))
def test_composed_layouts_with_distributed_optimizer_match(runs, reference, layout):
    _assert_same_run(_train_records(runs / layout), reference, rel=1e-5)


def test_checkpoint_resumes_at_cp2_exactly_and_loads_at_cp1(runs):
    uninterrupted = _train_records(runs / "cp2")
    later = {i: uninterrupted[i] for i in range(6, 11)}
    resumed = _train_records(runs / "cp2_resumed")
    assert {i: (r["lm_loss"], r["grad_norm"]) for i, r in resumed.items()} == {
        i: (r["lm_loss"], r["grad_norm"]) for i, r in later.items()
    }
    _assert_same_run(_train_records(runs / "cp1_loaded"), later, rel=1e-5)
