"""`gigatron pretrain gpt --mock-data` with the architectures' flags end to end: a gpt-oss-style
model (sliding windows, learned sinks, YaRN, quick GeGLU, q/k norms) and a DeepSeek-style one
(multi-latent attention, MoE, two multi-token prediction depths) train a few iterations, their
losses fall, and the MTP loss is logged as `mtp_loss` (training and validation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import WEIGHTS_ONLY, gigatron, pretrain, tiny_gpt_flags
from helpers import records as read_records

TINY = [
    *tiny_gpt_flags(hidden_size=32), "--global-batch-size", "4", "--lr", "3e-3", "--train-iters",
    "6", "--log-interval", "1", "--eval-interval", "6", "--eval-iters", "1", "--num-workers", "0",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
]  # fmt: skip

GPT_OSS = [
    "--window-size", "(3,0)", "--window-attn-skip-freq", "2", "--softmax-type", "learnable",
    "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
    "--yarn-original-max-position-embeddings", "8", "--no-yarn-correction-range-round-to-int",
    "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
    "--qk-layernorm", "--apply-layernorm-1p",
]  # fmt: skip

DEEPSEEK = [
    "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "16", "--kv-lora-rank", "16",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8",
    "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "1.0",
    "--mscale-all-dim", "1.0", "--swiglu", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "16",
    "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
]  # fmt: skip


def _pretrain(directory: Path, *flags: str) -> list[dict]:
    pretrain("gpt", *TINY, *flags, "--metrics-file", str(directory / "metrics.jsonl"))
    return read_records(directory)


def test_gpt_oss_style_model_trains(tmp_path):
    train = [r for r in _pretrain(tmp_path, *GPT_OSS) if r["type"] == "train"]
    assert len(train) == 6
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]


def test_deepseek_style_model_with_mtp_trains_and_logs_mtp_loss(tmp_path):
    records = _pretrain(tmp_path, *DEEPSEEK)
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 6
    assert all(isinstance(r["mtp_loss"], float) for r in train)
    # Random tokens: both losses start near ln(128) = 4.85 and fall.
    assert abs(train[0]["mtp_loss"] - 4.85) < 0.3
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]
    assert train[-1]["mtp_loss"] < train[0]["mtp_loss"]
    evals = [r for r in records if r["type"] == "eval"]
    assert evals and all("mtp_loss" in r for r in evals)


@pytest.mark.parametrize(
    "layout", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"]
)
def test_checkpoint_converts_to_one_process_and_evaluates_alike(tmp_path, layout):
    """MLA, MoE, MTP, sliding windows and sinks at tp = 2 or pp = 2 (torchrun, 2 processes),
    saved, re-split to one process by `convert-checkpoint`: the test losses (main and MTP) are
    the same."""
    flags = [*DEEPSEEK, "--window-size", "(5,0)", "--softmax-type", "learnable",
             "--vocab-size", "64", "--make-vocab-size-divisible-by", "32",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2",
             "--eval-interval", "2", "--deterministic-mode"]  # fmt: skip
    source, target = tmp_path / "src", tmp_path / "tp1"
    pretrain("gpt", *TINY, *flags, layout, "2", "--save", str(source), nproc=2)
    gigatron("convert-checkpoint", "--load", source, "--save", target,
             "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1")  # fmt: skip
    records = _pretrain(tmp_path, *flags, "--load", str(target), *WEIGHTS_ONLY)

    def test_losses(rows):
        (row,) = [r for r in rows if r["type"] == "eval" and r["split"] == "test"]
        return row["lm_loss"], row["mtp_loss"]

    source_rows = read_records(source)
    expected = test_losses(source_rows)
    for got, want in zip(test_losses(records), expected, strict=True):
        assert abs(got - want) < 1e-5, (got, want)
