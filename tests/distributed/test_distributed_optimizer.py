"""The distributed optimizer at dp = 2 against one process: trajectories (fp32, bf16, fp16 with
skipped steps), exact resume through the torch checkpoint format, and measured bytes per parameter.

dp = 4 and tp2 x dp2 cases run in test_data_parallel.py's world-4 spawn (one spawn for all).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_data_parallel import (
    BUCKET,
    ITERATIONS,
    VOCAB,
    Case,
    build,
    check_buckets,
    check_trajectory,
    make_config,
    reference,
    train_steps,
)

from gigatron.checkpoint.torch_format import load_checkpoint, save_checkpoint
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.optim.distributed_optimizer import DistributedOptimizer
from gigatron.optim.memory import memory_bytes_per_rank
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel

pytestmark = pytest.mark.distributed

OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_size": BUCKET}
CASES = [
    Case("distopt", distributed_optimizer=True),
    Case("distopt_overlap", distributed_optimizer=True, **OVERLAP),
    Case("distopt_bf16_overlap", precision="bf16", distributed_optimizer=True, **OVERLAP),
    Case("distopt_fp16", precision="fp16", distributed_optimizer=True, bucket_size=BUCKET),
]
RESUME_CASE = CASES[2]
HALF = ITERATIONS // 2

# Megatron's bytes per parameter with the distributed optimizer: a + b / d.
MEGATRON_DISTRIBUTED = {"fp16": (4, 16), "bf16": (6, 12), "fp32": (8, 8)}


def _memory_case(precision: str) -> tuple[Case, torch.dtype]:
    # Megatron's table rows: fp16 params + fp16 grads, bf16 params + fp32 grads, fp32.
    grad_dtype = torch.float16 if precision == "fp16" else torch.float32
    return Case(f"memory_{precision}", precision=precision, distributed_optimizer=True), grad_dtype


def run_all(rank: int, world_size: int, out_dir: str) -> None:
    pctx = ParallelContext.from_sizes()
    results: dict[str, torch.Tensor] = {}
    for case in CASES:
        _, chunk, optimizer = build(case, pctx, use_ddp=True)
        assert isinstance(optimizer, DistributedOptimizer)
        results[case.name] = torch.tensor(
            train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=True)
        )
        check_buckets(case, chunk)

    # Resume: half the iterations, a checkpoint, a fresh model (other seed) and optimizer that
    # load it, the other half; must continue exactly like the uninterrupted run.
    save_dir = Path(out_dir) / "ckpt"
    cfg, chunk, optimizer = build(RESUME_CASE, pctx, use_ddp=True)
    first = train_steps(chunk, optimizer, pctx, range(HALF), use_ddp=True)
    save_checkpoint(save_dir, HALF, [chunk], optimizer, None, pctx, cfg)
    cfg2, chunk2, optimizer2 = build(RESUME_CASE, pctx, use_ddp=True, seed=999)
    info = load_checkpoint(save_dir, [chunk2], optimizer2, None, pctx, cfg2)
    assert info["iteration"] == HALF
    second = train_steps(chunk2, optimizer2, pctx, range(HALF, ITERATIONS), use_ddp=True)
    results["resumed"] = torch.tensor(first + second)

    # Bytes per parameter, measured from storages after one step (optimizer state allocated).
    memory = {}
    for precision in ("fp32", "bf16", "fp16"):
        case, grad_dtype = _memory_case(precision)
        cfg = make_config(case)
        (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
        chunk = DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=grad_dtype)
        optimizer = build_optimizer(cfg, [chunk], pctx)
        train_steps(chunk, optimizer, pctx, range(1), use_ddp=True)
        numel = sum(p.numel() for p in model.parameters())
        measured = memory_bytes_per_rank([chunk], optimizer)
        memory[precision] = torch.tensor(measured["total"] / numel)
    results["memory"] = torch.stack([memory[p] for p in ("fp32", "bf16", "fp16")])
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def test_dp2_distributed_optimizer_trajectories_resume_and_memory(tmp_path):
    run_distributed(run_all, 2, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    for case in CASES:
        check_trajectory(case.name, results[case.name], reference(case), case.precision)
    # fp16: some steps were really skipped (and the same ones as in one process, checked above)
    assert (results["distopt_fp16"][:, 2] == 0).any()
    # resume is exact: bit for bit the uninterrupted run
    assert torch.equal(results["resumed"], results[RESUME_CASE.name])
    # the gathered optimizer state loads at another data-parallel size: dp = 1 continues the run
    pctx = ParallelContext.single()
    cfg, chunk, optimizer = build(RESUME_CASE, pctx, use_ddp=True, seed=7)
    load_checkpoint(tmp_path / "ckpt", [chunk], optimizer, None, pctx, cfg)
    continued = torch.tensor(
        train_steps(chunk, optimizer, pctx, range(HALF, ITERATIONS), use_ddp=True)
    )
    check_trajectory("resumed at dp 1", continued, results[RESUME_CASE.name][HALF:], "bf16")
    # 2 data-parallel ranks: 4 + 16/2 = 6 + 12/2 = 8 + 8/2 = 12 bytes per parameter
    for precision, measured in zip(("fp32", "bf16", "fp16"), results["memory"].tolist()):
        a, b = MEGATRON_DISTRIBUTED[precision]
        assert measured == pytest.approx(a + b / 2, abs=0.05), precision


def test_distributed_optimizer_needs_sharded_ddp():
    from gigatron.errors import GigatronError

    case = Case("bad", distributed_optimizer=True)
    pctx = ParallelContext.single()
    cfg, chunk, _ = build(dataclasses.replace(case, distributed_optimizer=False), pctx, True)
    with pytest.raises(GigatronError, match="DistributedDataParallel"):
        DistributedOptimizer(cfg, [chunk], pctx)
