"""Optimizer step and checkpoint save/load: gigatron against the plain-PyTorch reference.

    python benchmarks/bench_optimizer.py [--hidden 512] [--layers 4] [--repeats 5]

Rows (one process, CPU by default; timings are the best of --repeats runs):
- fp32 Adam step with clipping: gigatron FP32Optimizer.step() vs torch.optim.AdamW.step() after
  torch.nn.utils.clip_grad_norm_;
- bf16 mixed-precision step (fp32 main params, copy back) vs the same fp32 reference;
- checkpoint save: save_checkpoint (atomic, per-rank layout) vs one torch.save of the same state;
- checkpoint load: load_checkpoint (weights_only) vs torch.load(weights_only=False) + load_state_dict.
Prints a markdown table; ratio = gigatron / reference (lower is better).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from gigatron.checkpoint.torch_format import load_checkpoint, save_checkpoint
from gigatron.config import GigatronConfig
from gigatron.optim import build_lr_scheduler, build_optimizer
from gigatron.parallel.context import ParallelContext


def make_model(hidden: int, layers: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU()]
        blocks += [nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*blocks)


def make_cfg(bf16: bool) -> GigatronConfig:
    cfg = GigatronConfig()
    cfg.optimizer.lr = 1e-4
    cfg.optimizer.clip_grad = 1.0
    cfg.training.train_iters = 100
    cfg.training.global_batch_size = 8
    cfg.training.bf16 = bf16
    return cfg


def fill_grads(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def best_time(fn, repeats: int) -> float:
    """Fastest of `repeats` runs after a warm-up (the least disturbed by other load)."""
    fn()  # warm-up (lazy optimizer state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    pctx = ParallelContext.single()
    base = make_model(args.hidden, args.layers)
    n_params = sum(p.numel() for p in base.parameters())
    rows = []

    # reference step: torch AdamW (same param groups) after torch clipping
    ref_model = copy.deepcopy(base)
    decay = [p for p in ref_model.parameters() if p.dim() > 1]
    no_decay = [p for p in ref_model.parameters() if p.dim() == 1]
    ref_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
    )
    fill_grads(ref_model)

    def ref_step():
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()

    ref_time = best_time(ref_step, args.repeats)

    for label, bf16 in (("fp32 Adam step + clip", False), ("bf16 mixed-precision step", True)):
        model = copy.deepcopy(base).to(torch.bfloat16 if bf16 else torch.float32)
        opt = build_optimizer(make_cfg(bf16), [model], pctx)

        fill_grads(model)  # the gradients stay in place between steps, as for the reference
        rows.append((label, best_time(opt.step, args.repeats), ref_time))

    # checkpoints
    cfg = make_cfg(False)
    model = copy.deepcopy(base)
    opt = build_optimizer(cfg, [model], pctx)
    sched = build_lr_scheduler(cfg, opt)
    fill_grads(model)
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        counter = iter(range(10**6))
        save_time = best_time(
            lambda: save_checkpoint(tmp / "g", next(counter), [model], opt, sched, pctx, cfg),
            args.repeats,
        )
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "opt_param_scheduler": sched.state_dict(),
        }
        ref_save = best_time(lambda: torch.save(state, tmp / "ref.pt"), args.repeats)
        rows.append(("checkpoint save", save_time, ref_save))
        load_time = best_time(
            lambda: load_checkpoint(tmp / "g", [model], opt, sched, pctx, cfg), args.repeats
        )

        def ref_load():
            loaded = torch.load(tmp / "ref.pt", weights_only=False)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])

        rows.append(("checkpoint load", load_time, best_time(ref_load, args.repeats)))

    print(f"model: {args.layers} MLP blocks, hidden {args.hidden}, {n_params / 1e6:.1f}M params")
    print("| operation | gigatron (ms) | reference (ms) | ratio |")
    print("|---|---|---|---|")
    for label, ours, ref in rows:
        print(f"| {label} | {ours * 1e3:.1f} | {ref * 1e3:.1f} | {ours / ref:.2f} |")


if __name__ == "__main__":
    main()
