"""Resuming gigatron from the checkpoints Megatron-LM wrote (tests/data/megatron-fixtures, made
by tests/tools/make_megatron_fixtures.py): the batches Megatron trained on next are fed through
gigatron's own loop, and its losses are compared with the ones Megatron recorded."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gigatron.families import get_family
from gigatron.training.pretrain import parse_pretrain_config, pretrain

FIXTURES = Path(__file__).resolve().parent / "data" / "megatron-fixtures"
# Megatron's training flags of every fixture (make_megatron_fixtures.COMMON) that gigatron reads;
# the model shape comes from the checkpoint's saved arguments.
TRAINING = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63",
    "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
    "--exit-interval", "5", "--lr", "0.01", "--min-lr", "0.001", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--adam-beta2", "0.95",
    "--clip-grad", "0.0", "--seed", "1234", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--eval-iters", "0", "--log-interval", "1",
]  # fmt: skip


def record(name: str) -> dict[str, Any]:
    """The fixture's fixture.json: Megatron's flags, its losses and the next batches."""
    return json.loads((FIXTURES / name / "fixture.json").read_text())


class NextBatches:
    """A dataset whose samples at the consumed position are Megatron's next two batches."""

    def __init__(self, fixture: dict[str, Any], total: int, at_start: bool = False) -> None:
        rows = [*fixture["batch_step4"], *fixture["batch_step5"]]
        # at_start (--finetune: a new run): the batches come first
        self.start = 0 if at_start else fixture["iteration"] * len(fixture["batch_step4"])
        self.rows = [np.asarray(row, dtype=np.int64) for row in rows]
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        offset = index - self.start
        text = self.rows[offset] if 0 <= offset < len(self.rows) else self.rows[0] * 0
        seq = len(text) - 1
        return {
            "tokens": text[:-1].copy(),
            "labels": text[1:].copy(),
            "loss_mask": np.ones(seq, dtype=np.float32),
            "position_ids": np.arange(seq, dtype=np.int64),
        }


def fixture_family(fixture: dict[str, Any]):
    """The gpt family with Megatron's next batches as its training data."""

    def datasets(cfg, tokenizer, num_samples, pctx=None):
        return NextBatches(fixture, num_samples[0], cfg.checkpoint.finetune), None, None

    return dataclasses.replace(get_family("gpt"), build_datasets=datasets)


def gigatron_flags(name: str, *extra: str) -> list[str]:
    """gigatron's flags for resuming fixture `name`: --load and Megatron's training flags."""
    fixture = record(name)
    global_batch = len(fixture["batch_step4"])
    return [*TRAINING, "--global-batch-size", str(global_batch),
            "--load", str(FIXTURES / name), *extra]  # fmt: skip


def resume(name: str, tmp: Path, *extra: str, world_size: int = 1) -> dict[int, float]:
    """gigatron's losses of iterations 4 and 5 resumed from fixture `name` (this process)."""
    flags = gigatron_flags(name, "--metrics-file", str(tmp / "metrics.jsonl"), *extra)
    cfg = parse_pretrain_config(flags, world_size=world_size)
    result, _ = pretrain(cfg, stream=io.StringIO(), family=fixture_family(record(name)))
    return result.train_losses


def main(argv: list[str]) -> None:
    """Under torchrun: resume each `NAME[:FLAG,...]` of argv[1:] and write rank 0's losses to
    the JSON file argv[0] (tests at tp 2)."""
    import torch.distributed as dist

    out, results = Path(argv[0]), {}
    for spec in argv[1:]:
        name, _, flags = spec.partition(":")
        tmp = out.parent / f"{name}-{os.environ.get('RANK', '0')}"
        tmp.mkdir(parents=True, exist_ok=True)
        extra = [f for f in flags.split(",") if f]
        results[name] = resume(name, tmp, *extra, world_size=int(os.environ["WORLD_SIZE"]))
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(results))
    assert not dist.is_initialized()


if __name__ == "__main__":
    main(sys.argv[1:])
