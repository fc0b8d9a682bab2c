"""The GPU script's CPU dry run (benchmarks/gpu/run.py --dry-run): the checks run or are
skipped with their reason, every model and variant gives figures or the reason it cannot run,
and the JSON and the BENCHMARKS.md rows are written."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from helpers import run

ROOT = Path(__file__).resolve().parents[2]
# --no-compile: torch.compile on a CPU costs minutes (the GPU run compiles).
VARIANTS = "gigatron_eager,gigatron_compiled_fp8,megatron_core,hf_compiled"
CPU_CHECKS = {
    "test_bf16_trains_like_fp32", "test_fp16_with_dynamic_loss_scaling",
    "test_fp8_trains_like_bf16[tensorwise]", "test_fp8_trains_like_bf16[rowwise]",
    "test_checkpoint_save_and_resume", "test_inference_engine_greedy_matches_full_forward",
}  # fmt: skip


@pytest.mark.slow
def test_dry_run_reports_every_check_and_variant(tmp_path):
    run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "run.py"), "--dry-run",
         "--no-compile", "--in-process", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
         "--models", "llama-1b,gpt2-124m", "--variants", VARIANTS], timeout=600)  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["environment"]["device"] == "cpu" and report["matmul"]["tflops"] > 0

    checks = {c["name"]: c for c in report["checks"]}
    assert {name for name, c in checks.items() if c["outcome"] == "passed"} == CPU_CHECKS
    skipped = {name: c["message"] for name, c in checks.items() if c["outcome"] == "skipped"}
    assert (
        len(skipped) == 12
        and "needs CUDA" in skipped["test_fused_model_trains_like_the_unfused_one"]
    )
    assert "torch.compile left out" in skipped["test_compiled_trains_like_eager"]

    results = {(r["model"], r["variant"]): r for r in report["results"]}
    assert len(results) == 8
    for model in ("llama-1b", "gpt2-124m"):
        for variant in ("gigatron_eager", "gigatron_compiled_fp8", "hf_compiled"):
            r = results[model, variant]
            assert r["status"] == "ok", r
            assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0
            assert abs(r["loss"] - math.log(128)) < 0.3  # random tokens over a 128 vocabulary
        assert "--fp8-format" in results[model, "gigatron_compiled_fp8"]["flags"]
        core = results[model, "megatron_core"]
        assert core["status"] == "ok" or (core["status"] == "skipped" and core["reason"])
    assert results["llama-1b", "gigatron_eager"]["shape"]["kv_heads"] == 2

    rows = (tmp_path / "rows.md").read_text()
    assert rows.startswith("## GPU training throughput (issue 26)")
    assert rows.count("\n| llama-1b |") == 4 and "Checks (gpu_checks.py): 6 passed" in rows

    # Several device calls' results joined into one report.
    merged = tmp_path / "merged"
    results = str(tmp_path / "results.json")
    run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "run.py"), "--merge", results, results,
         "--out", str(merged)], timeout=120)  # fmt: skip
    joined = json.loads((merged / "results.json").read_text())
    assert len(joined["results"]) == 16 and len(joined["checks"]) == 2 * len(checks)
    assert (merged / "rows.md").read_text().count("\n| llama-1b |") == 8
