"""`gigatron quickstart` end to end at a tiny size: every output exists and the loss fell."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gigatron.quickstart import log_interval


def test_quickstart_tiny(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "gigatron.cli", "quickstart", "--output-dir", str(out),
        "--iterations", "40", "--hidden-size", "32", "--num-layers", "1", "--seq-length", "32",
        "--vocab-size", "300", "--lr", "1e-2", "--sample-tokens", "8", "--minutes", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in (
        "corpus.jsonl", "tokenizer/vocab.json", "tokenizer/merges.txt",
        "data/pydoc_text_document.bin", "data/pydoc_text_document.idx",
        "checkpoints/latest_checkpointed_iteration.txt", "metrics.jsonl", "summary.json",
    ):  # fmt: skip
        assert (out / name).is_file(), name
    with open(out / "loss.png", "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    corpus = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert len(corpus) > 50 and all(doc["text"] for doc in corpus)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["type"] == "eval" and r["split"] == "valid"]
    assert valid[0]["iteration"] == 0
    # The untrained model is near uniform over the 300-token vocabulary (ln 300 = 5.70) ...
    assert abs(valid[0]["lm_loss"] - 5.70) < 0.3
    # ... and training brings the held-out loss well down.
    assert valid[-1]["lm_loss"] < valid[0]["lm_loss"] - 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["valid_loss_end"] == valid[-1]["lm_loss"]
    assert "sample (top-5 sampling" in result.stdout
    assert "validation loss: " in result.stdout
    # A smooth training curve: every iteration logged (every few on longer runs) ...
    logged = [r["iteration"] for r in records if r["type"] == "train"]
    assert logged == list(range(1, summary["iterations"] + 1))
    assert log_interval(800) == 4  # the default run: 200 points
    # ... and the plot says what was trained.
    (startup,) = [r for r in records if r["type"] == "startup"]
    millions = startup["parameters"] / 1e6
    assert summary["plot_title"] == (
        f"gigatron quickstart: GPT 1 layers x 32 hidden, {millions:.2f}M parameters\n"
        "seq 32, global batch 16, vocab 300, lr 0.01, 40 iterations"
    )
