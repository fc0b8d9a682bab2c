"""`gigatron pretrain retro` under torchrun (Gloo): tp 2 with sequence parallelism, dp 2 and pp 2
give the one-process losses (pp 2 once with the embedded neighbours crossing the stage boundary,
6 layers, and once with the encoder's output crossing it, 9 layers split 6 | 3); retro-fitting a gpt checkpoint with the gate closed starts at that
GPT's loss; a run reads the neighbours of a real Retro project (WikiText-2 paragraphs).

One launch per process count (tests/gigatron_sequence.py); each test checks its runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.retro.query import QuerySettings, query_split
from gigatron.data.retro.samples import SampleChunks
from helpers import gigatron_runs, train_values
from retro_data_helpers import (
    GPT_FILES,
    bag_of_tokens,
    brute_force,
    gpt_config,
    tiny_database,
)

MODEL = [
    "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0",
    "--num-workers", "0", "--deterministic-mode", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip
RETRO = [
    "--retro-gpt-chunk-length", "4", "--retro-encoder-hidden-dropout", "0",
    "--retro-encoder-attention-dropout", "0",
]  # fmt: skip
MOCK = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "32",
]  # fmt: skip
PROJECT_SEQ, PROJECT_CHUNK = 32, 8
GPT2 = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    GPT_FILES[0],
    "--merge-file",
    GPT_FILES[1],
]


def build_project(root: Path) -> tuple[str, Path]:
    """A Retro project over 40 WikiText-2 paragraphs with exact (brute force) neighbours for the
    train samples of the run below (3 iterations of 4 samples)."""
    prefix, tokenizer, project, database, embeddings = tiny_database(
        root, PROJECT_SEQ, PROJECT_CHUNK, doc_block_size=16
    )
    cfg = gpt_config(prefix, PROJECT_SEQ, split="100,0,0")
    train, _, _ = build_gpt_datasets(cfg, tokenizer, (12, None, None))
    identity = {"db_identity": database.identity, "dataset_description": train.description}
    query_split(
        project, "train", SampleChunks(train, [prefix], PROJECT_SEQ, PROJECT_CHUNK),
        bag_of_tokens, lambda queries, k: brute_force(embeddings, queries, k), database,
        identity, QuerySettings(4, 2, block_size=16),
    )  # fmt: skip
    return prefix, project.root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("retro_pretrain")
    prefix, project = build_project(root)

    def retro(name: str, *flags: str) -> list[str]:
        metrics = ["--metrics-file", str(root / f"{name}.jsonl")]
        return ["pretrain", "retro", *MODEL, *RETRO, *MOCK, *metrics, *flags]

    def gpt(name: str, *flags: str) -> list[str]:
        metrics = ["--metrics-file", str(root / f"{name}.jsonl")]
        return ["pretrain", "gpt", *MODEL, *MOCK, *metrics, *flags]

    saved = str(root / "gpt")
    real = [
        "pretrain", "retro", *MODEL, *RETRO, "--seq-length", str(PROJECT_SEQ),
        "--retro-gpt-chunk-length", str(PROJECT_CHUNK), "--data-path", prefix, "--split",
        "100,0,0", "--data-cache-path", str(Path(prefix).parent / "cache"),
        "--retro-project-dir", str(project), *GPT2, "--metrics-file",
        str(root / "real.jsonl"),
    ]  # fmt: skip
    tp = ["--tensor-model-parallel-size", "2"]
    pp = ["--pipeline-model-parallel-size", "2"]
    nine = ["--num-layers", "9"]  # Retro layers 6 (the encoder's) and 9
    gigatron_runs(
        root,
        {
            "tp2_sp": (2, retro("tp2_sp", *tp, "--sequence-parallel")),
            "dp2": (2, retro("dp2")),
            "pp2": (2, retro("pp2", *pp)),
            "pp2_encoded": (
                2,
                retro("pp2_encoded", *nine, *pp, "--decoder-first-pipeline-num-layers", "6"),
            ),
            "one": (1, retro("one")),
            "one_nine": (1, retro("one_nine", *nine)),
            "gpt_save": (1, gpt("gpt_save", "--save", saved)),
            "gpt_next": (1, gpt("gpt_next", "--load", saved, "--finetune")),
            "retrofit": (1, retro("retrofit", "--load", saved, "--retro-attention-gate", "0")),
            "real": (1, real),
        },
    )
    return root


def losses(root: Path, name: str) -> dict[int, float]:
    return train_values(root / f"{name}.jsonl")


@pytest.mark.parametrize(
    "layout, reference",
    [("tp2_sp", "one"), ("dp2", "one"), ("pp2", "one"), ("pp2_encoded", "one_nine")],
)
def test_parallel_losses_equal_one_process(runs, layout, reference):
    one = losses(runs, reference)
    assert sorted(one) == [1, 2, 3] and one[3] < one[1]
    assert losses(runs, layout) == pytest.approx(one, rel=1e-5, abs=1e-5)


def test_retrofit_with_closed_gate_starts_at_the_gpts_loss(runs):
    gpt, retro = losses(runs, "gpt_next"), losses(runs, "retrofit")
    assert retro[1] == pytest.approx(gpt[1], rel=1e-6)
    out = (runs / "retrofit.out").read_text()
    assert "retro-fitted the gpt checkpoint" in out and "iteration 3" in out


def test_real_project_neighbours_train(runs):
    real = losses(runs, "real")
    assert sorted(real) == [1, 2, 3]
    assert all(9.0 < value < 12.0 for value in real.values())  # ~ln(50257) at the start
