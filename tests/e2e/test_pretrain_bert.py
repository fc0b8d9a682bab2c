"""`gigatron pretrain bert` end to end on a real sentence-split corpus: training lowers both
losses, and tensor (+ sequence), pipeline, data parallelism with the distributed optimizer and
context parallelism give the one-process losses; a saved run resumes and converts like GPT's."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import BERT_VOCAB as VOCAB
from helpers import pretrain, records


def _flags(data: str, save: Path, *extra: str) -> list[str]:
    return [
        "--data-path", data, "--split", "90,8,2", "--tokenizer-type", "BertWordPieceLowerCase",
        "--vocab-file", str(VOCAB), "--padded-vocab-size", "30720",  # the same at every tp
        "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "1e-2", "--log-interval", "1",
        "--eval-interval", "5", "--eval-iters", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--num-workers", "0", "--save", str(save), *extra,
    ]  # fmt: skip


def _train(flags: list[str], nproc: int = 1) -> None:
    pretrain("bert", *flags, nproc=nproc)


@pytest.fixture(scope="module")
def reference(wordpiece_corpus, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bert-one")
    _train(_flags(wordpiece_corpus, directory, "--train-iters", "10"))
    return directory


def test_both_losses_are_logged_and_fall(reference):
    train = records(reference, "train")
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert all(r["mlm_loss"] > 0 and r["sop_loss"] > 0 for r in train)
    first, last = train[0], train[-1]
    assert last["mlm_loss"] < first["mlm_loss"] - 1.0  # ln(30522) ~ 10.3 at the start
    evals = records(reference, "eval")
    assert {"mlm_loss", "sop_loss", "mlm_loss_ppl"} <= set(evals[0])


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--pipeline-model-parallel-size", "2"],
        ["--use-distributed-optimizer"],
        ["--context-parallel-size", "2"],
    ],
    ids=["tp2-sp", "pp2", "dp2-distopt", "cp2"],
)
def test_parallel_layouts_match_one_process(wordpiece_corpus, reference, tmp_path, layout):
    _train(_flags(wordpiece_corpus, tmp_path, "--train-iters", "10", *layout), nproc=2)
    one = {r["iteration"]: r for r in records(reference, "train")}
    two = {r["iteration"]: r for r in records(tmp_path, "train")}
    assert sorted(two) == sorted(one)
    for name in ("mlm_loss", "sop_loss"):
        expected = [one[i][name] for i in sorted(one)]
        assert [two[i][name] for i in sorted(two)] == pytest.approx(expected, rel=2e-5), name


def test_no_binary_head_logs_only_the_masked_lm_loss(wordpiece_corpus, tmp_path):
    _train(_flags(wordpiece_corpus, tmp_path, "--train-iters", "2", "--bert-no-binary-head"))
    train = records(tmp_path, "train")
    assert all("mlm_loss" in r and "sop_loss" not in r for r in train)


def test_resume_continues_exactly(wordpiece_corpus, reference, tmp_path):
    _train(_flags(wordpiece_corpus, tmp_path, "--train-iters", "10", "--exit-interval", "5"))
    _train(_flags(wordpiece_corpus, tmp_path, "--train-iters", "10", "--load", str(tmp_path)))
    one = {r["iteration"]: r["mlm_loss"] for r in records(reference, "train")}
    resumed = {r["iteration"]: r["mlm_loss"] for r in records(tmp_path, "train")}
    assert [resumed[i] for i in range(6, 11)] == [one[i] for i in range(6, 11)]


def _test_losses(metrics: Path) -> dict[str, float]:
    (test,) = [r for r in records(metrics, "eval") if r["split"] == "test"]
    return {name: test[name] for name in ("mlm_loss", "sop_loss")}


def test_convert_checkpoint_to_other_layouts_evaluates_the_same(wordpiece_corpus, tmp_path):
    from gigatron.checkpoint.convert import convert_checkpoint

    source = tmp_path / "tp2"
    _train(
        _flags(wordpiece_corpus, source, "--train-iters", "2", "--tensor-model-parallel-size", "2"),
        2,
    )
    expected = _test_losses(source / "metrics.jsonl")
    weights_only = ["--no-load-optim", "--no-load-rng", "--skip-train", "--train-iters", "2"]
    for name, sizes, layout, nproc in (
        ("tp1", (1, 1), [], 1),
        ("pp2", (1, 2), ["--pipeline-model-parallel-size", "2"], 2),
    ):
        target = tmp_path / name
        convert_checkpoint(source, target, target_tp=sizes[0], target_pp=sizes[1])
        metrics = tmp_path / f"{name}.jsonl"
        flags = _flags(wordpiece_corpus, tmp_path / f"{name}-out", *weights_only, *layout)
        _train([*flags, "--load", str(target), "--metrics-file", str(metrics)], nproc)
        assert _test_losses(metrics) == pytest.approx(expected, abs=1e-5), name
