"""No host synchronisation inside a training step: gigatron's code reads no number off a tensor
(`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`, `float()`, `int()`) except in the
iterations that write a log line. On a GPU each such read waits for every queued kernel."""

from __future__ import annotations

import io
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from gigatron.training.metrics import MetricsLogger
from gigatron.training.pretrain import parse_pretrain_config, pretrain

SRC = str(Path(__file__).resolve().parents[2] / "src" / "gigatron")
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "8", "--log-interval", "4", "--lr", "1e-3",
    "--mock-data", "--vocab-size", "128", "--eval-iters", "0", "--clip-grad", "1.0",
    "--device", "cpu",
    # The default --rerun-mode validate_results reads each iteration's loss before its update
    # (one synchronisation a step, as Megatron's) to re-run a faulty iteration; disabled leaves
    # the step without any, a non-finite value found at the next log line.
    "--rerun-mode", "disabled",
]  # fmt: skip


def _count_reads(monkeypatch) -> Counter:
    """(iteration, reading function) -> reads made by gigatron's own code (torch's internal
    reads of CPU scalars, e.g. AdamW's step counters, are not host synchronisations on a GPU
    either)."""
    reads: Counter = Counter()
    current = [0]
    started = MetricsLogger.iteration_started

    def iteration_started(self, iteration: int) -> None:
        current[0] = iteration
        started(self, iteration)

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(SRC):
                reads[current[0], sys._getframe(1).f_code.co_name] += 1
            return original(self, *args, **kwargs)

        return read

    monkeypatch.setattr(MetricsLogger, "iteration_started", iteration_started)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return reads


@pytest.mark.parametrize(
    "extra", [[], ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"]]
)
def test_reads_happen_only_in_iterations_that_log(monkeypatch, tmp_path, extra):
    metrics = ["--metrics-file", str(tmp_path / "metrics.jsonl")]
    cfg = parse_pretrain_config([*FLAGS, *extra, *metrics], world_size=1)
    reads = _count_reads(monkeypatch)
    result, _ = pretrain(cfg, stream=io.StringIO(), progress_bar=False)
    assert sorted(result.train_losses) == list(range(1, 9))
    # Iterations 4 and 8 log (and read the four iterations before them at once); the start-up
    # record, written once after the first iteration, counts the parameters.
    elsewhere = {key for key in reads if key[0] not in (4, 8)}
    assert elsewhere == {(1, "count_parameters_by_kind")}, reads
    assert {key[0] for key in reads} == {1, 4, 8}
