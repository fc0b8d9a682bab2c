"""Save / load time and peak memory of the checkpoint formats, side by side in one run:
`torch` (Megatron's per-rank files), `torch_dist` (DCP, sharded) and `torch_dist` with
`--async-save` (the time the training loop is blocked, the whole write, and training steps taken
while the write is in flight).

    python benchmarks/bench_checkpoint_formats.py [--hidden 2048 --layers 4 --vocab 32768]
        [--world 4 --tp 2] [--dir /tmp/ckpt-bench]

Spawns `--world` Gloo processes (tp x dp, distributed optimizer, fp32), takes one training step
(so Adam's moments exist), then saves and loads in each format. Times are the slowest rank's;
peak memory is the largest rise of a rank's resident set during the operation (sampled every
2 ms), per rank. The default shape is a GPT of about 1 GB of fp32 weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from gigatron.checkpoint import dist_format, torch_format
from gigatron.checkpoint.async_save import AsyncCheckpointSaver
from gigatron.config.root import GigatronConfig
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel

SEQ = 16
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The largest rise of this process's resident set while the block runs."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss())
        self.rise = self.peak - self.base


def build(args, pctx: ParallelContext):
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 16
    m.seq_length = m.max_position_embeddings = SEQ
    m.padded_vocab_size = args.vocab
    m.hidden_dropout = m.attention_dropout = 0.0
    cfg.parallel.tensor_model_parallel_size = args.tp
    cfg.parallel.use_distributed_optimizer = True
    cfg.optimizer.lr = 1e-4
    (model,) = build_model(cfg, pctx, vocab_size=args.vocab)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=torch.float32)
    optimizer = build_optimizer(cfg, [chunk], pctx)
    return cfg, chunk, optimizer


def step(chunk, optimizer, pctx) -> float:
    from gigatron.families.gpt import token_losses
    from gigatron.parallel.grad_sync import finalize_model_grads

    start = time.perf_counter()
    tokens = torch.randint(0, 1000, (1, SEQ + 1))
    positions = torch.arange(SEQ).unsqueeze(0)
    optimizer.zero_grad()
    loss = token_losses(chunk(tokens[:, :-1], positions, None), tokens[:, 1:], pctx).mean()
    loss.backward()
    finalize_model_grads([chunk], pctx)
    optimizer.step()
    return time.perf_counter() - start


def timed(pctx, fn) -> tuple[float, float]:
    """(seconds on the slowest rank, peak RSS rise in GB on the largest rank)."""
    pctx.barrier()
    with PeakRSS() as peak:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    pctx.barrier()
    values = torch.tensor([elapsed, peak.rise / 1e9], dtype=torch.float64)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return float(values[0]), float(values[1])


def run(rank: int, world_size: int, args, out: str) -> None:
    torch.set_num_threads(1)
    pctx = ParallelContext.from_sizes(tp=args.tp)
    cfg, chunk, optimizer = build(args, pctx)
    first_step = step(chunk, optimizer, pctx)
    root = Path(args.dir)
    results: dict[str, dict[str, float]] = {}

    cfg.checkpoint.ckpt_format = "torch"
    save = timed(pctx, lambda: torch_format.save_checkpoint(
        root / "torch", 1, [chunk], optimizer, None, pctx, cfg))  # fmt: skip
    load = timed(pctx, lambda: torch_format.load_checkpoint(
        root / "torch", [chunk], optimizer, None, pctx, cfg))  # fmt: skip
    results["torch"] = {"save_s": save[0], "save_gb": save[1], "load_s": load[0],
                        "load_gb": load[1]}  # fmt: skip

    cfg.checkpoint.ckpt_format = "torch_dist"
    save = timed(pctx, lambda: dist_format.save_checkpoint(
        root / "dist", 1, [chunk], optimizer, None, pctx, cfg))  # fmt: skip
    load = timed(pctx, lambda: dist_format.load_iteration(
        root / "dist" / "iter_0000001", root / "dist", [chunk], optimizer, None, pctx, cfg,
        None, False))  # fmt: skip
    results["torch_dist"] = {"save_s": save[0], "save_gb": save[1], "load_s": load[0],
                             "load_gb": load[1]}  # fmt: skip

    saver = AsyncCheckpointSaver(pctx)
    steps: list[float] = []

    def async_save() -> None:
        saver.save(root / "async", 1, [chunk], optimizer, None, cfg)

    blocked = timed(pctx, async_save)
    start = time.perf_counter()
    while True:  # train while any rank's write runs (all ranks step together)
        flag = torch.tensor([float(saver.in_flight)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not flag.item():
            break
        steps.append(step(chunk, optimizer, pctx))
    saver.close()
    total = time.perf_counter() - start + blocked[0]
    counts = torch.tensor([len(steps), total], dtype=torch.float64)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    results["torch_dist_async"] = {
        "blocked_s": blocked[0],
        "blocked_gb": blocked[1],
        "total_s": float(counts[1]),
        "steps_during_save": float(counts[0]),
        "step_s_during_save": sum(steps) / len(steps) if steps else float("nan"),
    }
    plain = [step(chunk, optimizer, pctx) for _ in range(2)]
    results["steps"] = {"first_step_s": first_step, "step_s": sum(plain) / len(plain)}
    if rank == 0:
        iteration = root / "dist" / "iter_0000001"
        size = sum(f.stat().st_size for f in iteration.rglob("*"))
        stored = dist_format.read_metadata(iteration).state_dict_metadata
        params = sum(math.prod(v.size) for k, v in stored.items() if k.startswith("model."))
        results["sizes"] = {"torch_dist_gb": size / 1e9, "params": float(params)}
        Path(out).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    out = Path(args.dir) / "results.json"
    try:
        run_distributed(run, args.world, args, str(out))
        results = json.loads(out.read_text())
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(results, indent=1))
    t, d, a = results["torch"], results["torch_dist"], results["torch_dist_async"]
    print(f"\nparameters {results['sizes']['params'] / 1e6:.0f}M, torch_dist checkpoint "
          f"{results['sizes']['torch_dist_gb']:.2f} GB, world {args.world}, tp {args.tp}")  # fmt: skip
    print("| format | save s (loop blocked) | save peak RSS rise GB/rank | load s | load peak GB |")
    print("|---|---|---|---|---|")
    print(f"| torch | {t['save_s']:.2f} | {t['save_gb']:.2f} | {t['load_s']:.2f} | "
          f"{t['load_gb']:.2f} |")  # fmt: skip
    print(f"| torch_dist | {d['save_s']:.2f} | {d['save_gb']:.2f} | {d['load_s']:.2f} | "
          f"{d['load_gb']:.2f} |")  # fmt: skip
    print(f"| torch_dist --async-save | {a['blocked_s']:.2f} (write done after "
          f"{a['total_s']:.2f}, {a['steps_during_save']:.0f} steps meanwhile) | "
          f"{a['blocked_gb']:.2f} | as torch_dist | |")  # fmt: skip


if __name__ == "__main__":
    main()
