"""`gigatron finetune` under torchrun: data parallelism (2 ranks) and tensor parallelism (2 ranks,
with sequence parallelism) give the one-process losses and accuracies."""

from __future__ import annotations

from pathlib import Path

import pytest
from finetune_helpers import MNLI, finetune_flags, save_pretrained

from helpers import gigatron, gigatron_runs, records


def _summary(directory: Path) -> tuple[list[float], list[tuple[int, int]]]:
    losses = [r["lm_loss"] for r in records(directory, "train")]
    scores = [(r["correct"], r["total"]) for r in records(directory, "eval")]
    return losses, scores


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-parallel")
    save_pretrained(root / "pretrained")
    # The same weights split for tensor parallelism 2 (a torch checkpoint loads in its layout).
    gigatron("convert-checkpoint", "--load", str(root / "pretrained"),
             "--save", str(root / "pretrained-tp2"),
             "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1")  # fmt: skip
    files = f"{MNLI / 'dev_matched.tsv'} {MNLI / 'dev_mismatched.tsv'}"

    def flags(name: str, *extra: str) -> list[str]:
        pretrained = root / (
            "pretrained-tp2" if "--tensor-model-parallel-size" in extra else "pretrained"
        )
        return finetune_flags(
            "MNLI", pretrained, root / name, 32, train_data=files, valid_data=files,
            epochs="2", global_batch_size="4", eval_micro_batch_size="1",
        ) + list(extra)  # fmt: skip

    # every run in one launch per process count
    runs = {"one": (1, ["finetune", *flags("one")])}
    runs |= {name: (2, ["finetune", *flags(name, *extra)]) for name, extra in LAYOUTS}
    gigatron_runs(root, runs, timeout=1200)
    return root, flags, _summary(root / "one")


LAYOUTS = [
    ("dp2", []),
    ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
]


@pytest.mark.parametrize("name, extra", LAYOUTS)
def test_parallel_layouts_match_one_process(setup, name, extra):
    root, flags, (losses, scores) = setup
    parallel_losses, parallel_scores = _summary(root / name)
    assert len(losses) == 2
    assert parallel_losses == pytest.approx(losses, rel=1e-5)
    assert parallel_scores == scores
