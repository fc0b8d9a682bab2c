"""µP (`--use-mup`, width multiplier 2) at tp 2 and with the distributed optimizer at dp 2 gives
the one-process loss and grad-norm trajectory (test_data_parallel.py's harness: 10 iterations of
the tiny GPT through the real schedule), and that trajectory is not the standard one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_data_parallel import ITERATIONS, VOCAB, Case, check_trajectory, make_config, train_steps

from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel

pytestmark = pytest.mark.distributed

CASES = [Case("tp2", tp=2), Case("dp2_distopt", distributed_optimizer=True)]


def build_mup(case: Case, pctx: ParallelContext, use_ddp: bool, mup: bool = True):
    cfg = make_config(case)
    cfg.model.use_mup, cfg.model.mup_base_hidden_size = mup, 32  # hidden 64: multiplier 2
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel, torch.float32) if use_ddp else model
    return chunk, build_optimizer(cfg, [chunk], pctx)


def run_cases(rank: int, world_size: int, out_dir: str) -> None:
    results = {}
    for case in CASES:
        pctx = ParallelContext.from_sizes(tp=case.tp)
        chunk, optimizer = build_mup(case, pctx, use_ddp=True)
        results[case.name] = torch.tensor(
            train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=True)
        )
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def reference(mup: bool) -> torch.Tensor:
    pctx = ParallelContext.single()
    chunk, optimizer = build_mup(Case("one"), pctx, False, mup)
    return torch.tensor(train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=False))


def test_mup_tp2_and_distributed_optimizer_equal_one_process(tmp_path):
    run_distributed(run_cases, 2, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    want = reference(True)
    assert (want[:, 0] - reference(False)[:, 0]).abs().max() > 1e-3  # µP changes the run
    for case in CASES:
        check_trajectory(case.name, results[case.name], want, case.precision)
