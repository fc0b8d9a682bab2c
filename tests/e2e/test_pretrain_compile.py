"""`gigatron pretrain gpt --torch-compile` (inductor) under torchrun on CPU: the compiled layers
train like the eager ones (losses and gradient norms within 1e-5) at tp = 2 with sequence
parallelism and selective recomputation, at pp = 2, and at dp = 2 under the distributed
optimizer's hooks (overlapped reduction, full recomputation) and under FSDP2.

Every run is in one launch of two processes (tests/gigatron_sequence.py); the eager twins of the
compiled runs are the references. The dp = 2 runs have the pp = 2 layer's shapes, so inductor's
cache serves them the pp = 2 run's compiled graph."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import gigatron_runs, tiny_gpt_flags, train_values

TINY = [
    *tiny_gpt_flags(vocab_size=256, seq_length=32), "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
    "--no-progress-bar",
]  # fmt: skip
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--recompute-granularity", "selective"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "distopt": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                "--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"],
    "fsdp": ["--use-torch-fsdp2"],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """`<root>/<layout>_<eager|compiled>/metrics.jsonl` of every layout."""
    root = tmp_path_factory.mktemp("compile")
    commands = {}
    for layout, flags in LAYOUTS.items():
        for mode, extra in (("eager", []), ("compiled", ["--torch-compile"])):
            name = f"{layout}_{mode}"
            metrics = root / name / "metrics.jsonl"
            metrics.parent.mkdir()
            argv = ["pretrain", "gpt", *TINY, *flags, *extra, "--metrics-file", str(metrics)]
            commands[name] = (2, argv)
    gigatron_runs(root, commands, timeout=900)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_train_like_eager_ones(runs, layout):
    eager = runs / f"{layout}_eager" / "metrics.jsonl"
    compiled = runs / f"{layout}_compiled" / "metrics.jsonl"
    assert len(train_values(eager)) == 3
    for key in ("lm_loss", "grad_norm"):
        assert train_values(compiled, key) == pytest.approx(train_values(eager, key), rel=1e-5)
