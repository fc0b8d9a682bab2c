"""`gigatron pretrain bert` end to end on a real sentence-split corpus: training lowers both
losses, and tensor (+ sequence), pipeline, data parallelism with the distributed optimizer and
context parallelism give the one-process losses; a saved run resumes and converts like GPT's.
The runs go in a few launches (`runs`, helpers.gigatron_runs); each test checks its runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gigatron.checkpoint.convert import convert_checkpoint
from helpers import BERT_VOCAB as VOCAB
from helpers import gigatron_runs, records


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


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
    "cp2": ["--context-parallel-size", "2"],
}
# the tp 2 checkpoint converted to: name -> ((tp, pp), layout flags, processes)
CONVERTED = {
    "tp1": ((1, 1), [], 1),
    "pp2": ((1, 2), ["--pipeline-model-parallel-size", "2"], 2),
}
WEIGHTS_ONLY = ["--no-load-optim", "--no-load-rng", "--skip-train", "--train-iters", "2"]


@pytest.fixture(scope="module")
def runs(wordpiece_corpus, tmp_path_factory) -> Path:
    """Every run of this file, in two rounds of one launch per process count (process start-up
    dominates on CPU): trainings, then the resume and the converted checkpoints' evaluations."""
    root = tmp_path_factory.mktemp("bert")

    def command(save: str, *extra: str) -> list[str]:
        return ["pretrain", "bert", *_flags(wordpiece_corpus, root / save, *extra)]

    first = {
        "one": (1, command("one", "--train-iters", "10")),
        "no_binary_head": (1, command("no_binary_head", "--train-iters", "2",
                                      "--bert-no-binary-head")),
        "resume": (1, command("resume", "--train-iters", "10", "--exit-interval", "5")),
        "tp2": (2, command("tp2", "--train-iters", "2", "--tensor-model-parallel-size", "2")),
    }  # fmt: skip
    for name, layout in LAYOUTS.items():
        first[name] = (2, command(name, "--train-iters", "10", *layout))
    gigatron_runs(root, first)
    second = {"resumed": (1, command("resume", "--train-iters", "10", "--load", root / "resume"))}
    for name, ((tp, pp), layout, nproc) in CONVERTED.items():
        target = root / f"converted_{name}"
        convert_checkpoint(root / "tp2", target, target_tp=tp, target_pp=pp)
        flags = command(f"{name}-out", *WEIGHTS_ONLY, *layout)
        metrics = ["--metrics-file", root / f"{name}.jsonl"]
        second[f"evaluated_{name}"] = (nproc, [*flags, "--load", target, *metrics])
    gigatron_runs(root, second)
    return root


@pytest.fixture(scope="module")
def reference(runs) -> Path:
    return runs / "one"


def test_both_losses_are_logged_and_fall(reference):
    train = records(reference, "train")
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert all(r["mlm_loss"] > 0 and r["sop_loss"] > 0 for r in train)
    first, last = train[0], train[-1]
    assert last["mlm_loss"] < first["mlm_loss"] - 0.8  # ln(30522) ~ 10.3 at the start
    evals = records(reference, "eval")
    assert {"mlm_loss", "sop_loss", "mlm_loss_ppl"} <= set(evals[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_process(runs, reference, layout):
    one = {r["iteration"]: r for r in records(reference, "train")}
    two = {r["iteration"]: r for r in records(runs / layout, "train")}
    assert sorted(two) == sorted(one)
    for name in ("mlm_loss", "sop_loss"):
        expected = [one[i][name] for i in sorted(one)]
        assert [two[i][name] for i in sorted(two)] == pytest.approx(expected, rel=2e-5), name


def test_no_binary_head_logs_only_the_masked_lm_loss(runs):
    train = records(runs / "no_binary_head", "train")
    assert all("mlm_loss" in r and "sop_loss" not in r for r in train)


def test_resume_continues_exactly(runs, reference):
    one = {r["iteration"]: r["mlm_loss"] for r in records(reference, "train")}
    resumed = {r["iteration"]: r["mlm_loss"] for r in records(runs / "resume", "train")}
    assert [resumed[i] for i in range(6, 11)] == [one[i] for i in range(6, 11)]


def _test_losses(metrics: Path) -> dict[str, float]:
    (test,) = [r for r in records(metrics, "eval") if r["split"] == "test"]
    return {name: test[name] for name in ("mlm_loss", "sop_loss")}


def test_convert_checkpoint_to_other_layouts_evaluates_the_same(runs):
    expected = _test_losses(runs / "tp2" / "metrics.jsonl")
    for name in CONVERTED:
        assert _test_losses(runs / f"{name}.jsonl") == pytest.approx(expected, abs=1e-5), name
