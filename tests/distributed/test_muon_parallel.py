"""Muon (`--optimizer muon`) at dp 2, tp 2 (duplicated and distributed Newton-Schulz) and with
the distributed optimizer against one process: the same loss and grad-norm trajectory (the
harness of test_data_parallel.py: 10 iterations of the tiny GPT through the real schedule)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_data_parallel import (
    ITERATIONS,
    VOCAB,
    Case,
    check_trajectory,
    make_config,
    train_steps,
)

from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.optim.distributed_optimizer import DistributedOptimizer
from gigatron.optim.muon import Muon
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel

pytestmark = pytest.mark.distributed

# (case, --muon-tp-mode)
CASES = [
    (Case("dp2"), "duplicated"),
    (Case("tp2_duplicated", tp=2), "duplicated"),
    (Case("tp2_distributed", tp=2), "distributed"),
    (Case("dp2_distopt", distributed_optimizer=True, bucket_size=20_000), "duplicated"),
    (Case("dp2_distopt_bf16", precision="bf16", distributed_optimizer=True), "duplicated"),
]


def build_muon(case: Case, tp_mode: str, pctx: ParallelContext, use_ddp: bool):
    cfg = make_config(case)
    o = cfg.optimizer
    o.optimizer, o.muon_tp_mode, o.lr = "muon", tp_mode, 2e-3
    o.muon_fp32_matmul_prec = "high"  # fp32 steps: only summation order differs
    o.muon_nesterov = True
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel, torch.float32) if use_ddp else model
    return chunk, build_optimizer(cfg, [chunk], pctx)


def run_cases(rank: int, world_size: int, out_dir: str) -> None:
    results = {}
    for case, tp_mode in CASES:
        pctx = ParallelContext.from_sizes(tp=case.tp)
        chunk, optimizer = build_muon(case, tp_mode, pctx, use_ddp=True)
        assert isinstance(optimizer.optimizer, Muon)
        assert isinstance(optimizer, DistributedOptimizer) == case.distributed_optimizer
        results[case.name] = torch.tensor(
            train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=True)
        )
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def reference(precision: str) -> torch.Tensor:
    pctx = ParallelContext.single()
    chunk, optimizer = build_muon(Case("one", precision=precision), "duplicated", pctx, False)
    return torch.tensor(train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=False))


def test_muon_dp2_tp2_and_distributed_optimizer_equal_one_process(tmp_path):
    run_distributed(run_cases, 2, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    want = {"fp32": reference("fp32"), "bf16": reference("bf16")}
    # Muon learns here (the reference is not a flat line).
    assert float(want["fp32"][-1, 0]) < float(want["fp32"][0, 0]) - 0.05
    for case, _ in CASES:
        check_trajectory(case.name, results[case.name], want[case.precision], case.precision)
