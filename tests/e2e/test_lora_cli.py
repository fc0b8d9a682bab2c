"""`gigatron pretrain gpt --lora-target-modules ...` end to end: a base trained briefly (torch_dist,
so it loads at any layout), then LoRA fine-tunes of it through --pretrained-checkpoint: the
validation loss improves (and starts at the base's: new adapters change nothing), the start-up
record counts the adapters as the trainable parameters, checkpoints hold the adapters only and
resume exactly, and tensor parallel 2 trains the same losses as one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from gigatron.models.lora import is_adapter_name
from gigatron.torch_files import safe_load
from helpers import NO_DROPOUT, eval_record, gigatron_runs, records, tiny_gpt_flags, train_values

pytestmark = pytest.mark.distributed

TINY = [
    *tiny_gpt_flags(), "--padded-vocab-size", "128", "--global-batch-size", "4", "--num-workers", "0", "--log-interval", "1",
    "--eval-iters", "4", "--lr", "1e-2", "--train-iters", "30", "--eval-interval", "30",
    "--deterministic-mode", *NO_DROPOUT,  # dropout masks differ between layouts
]  # fmt: skip
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA = ["--lora-target-modules", *TARGETS, "--lora-rank", "8", "--lora-alpha", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    base = ["--pretrained-checkpoint", str(root / "base")]
    gigatron_runs(
        root,
        {
            "base": (2, ["pretrain", "gpt", *TINY, "--save", root / "base",
                         "--ckpt-format", "torch_dist"]),
            "tp2": (2, ["pretrain", "gpt", *TINY, *LORA, *base, "--tensor-model-parallel-size",
                        "2", "--exit-interval", "10", "--metrics-file", root / "tp2.jsonl"]),
            "lora": (1, ["pretrain", "gpt", *TINY, *LORA, *base, "--eval-at-start", "--save",
                         root / "lora", "--save-interval", "10"]),
            "resume": (1, ["pretrain", "gpt", *TINY, *LORA, *base, "--load", root / "lora",
                           "--ckpt-step", "10", "--metrics-file", root / "resume.jsonl"]),
        },
    )  # fmt: skip
    return root


def test_lora_fine_tune_improves_the_validation_loss(runs):
    evals = [r for r in records(runs / "lora", "eval") if r["split"] == "valid"]
    assert [r["iteration"] for r in evals] == [0, 30]
    # New adapters (B = 0) leave the base model: the base's own validation loss on those samples.
    base_valid = eval_record(runs / "base", "valid")["lm_loss"]
    assert evals[0]["lm_loss"] == pytest.approx(base_valid, rel=1e-5)
    assert evals[1]["lm_loss"] < evals[0]["lm_loss"] - 0.1


def test_trainable_parameters_and_optimizer_memory_are_reported(runs):
    (startup,) = records(runs / "lora", "startup")
    # Per layer, A [8, in] and B [out, 8]: qkv 64 -> 192, proj 64 -> 64, fc1 64 -> 256, fc2 256 -> 64.
    per_layer = 8 * (64 + 192) + 8 * (64 + 64) + 8 * (64 + 256) + 8 * (256 + 64)
    assert startup["trainable_parameters"] == 2 * per_layer
    (memory,) = startup["bytes_per_rank"]
    assert memory["gradient_bytes"] == 4 * 2 * per_layer  # frozen weights get no gradient
    assert 8 * 2 * per_layer <= memory["optimizer_state_bytes"] < 4 * 4 * 2 * per_layer
    log = (runs / "lora.out").read_text()
    assert f"> trainable parameters: {2 * per_layer:,}" in log


def test_checkpoints_hold_the_adapters_only_and_resume_exactly(runs):
    saved = safe_load(runs / "lora" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    names = list(saved["model"])
    assert len(names) == 2 * 4 * 2 and all(is_adapter_name(n) for n in names)
    full, resumed = train_values(runs / "lora"), train_values(runs / "resume.jsonl")
    assert sorted(resumed) == list(range(11, 31))
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(full[iteration], rel=1e-6), iteration


def test_lora_at_tp2_trains_as_one_process(runs):
    tp2, tp1 = train_values(runs / "tp2.jsonl"), train_values(runs / "lora")
    assert sorted(tp2) == list(range(1, 11))
    for iteration, loss in tp2.items():
        assert loss == pytest.approx(tp1[iteration], rel=1e-5), iteration
    assert tp1[10] != pytest.approx(tp1[1], rel=1e-3)  # the adapters did train
