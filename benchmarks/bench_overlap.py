"""Iteration time with and without --overlap-grad-reduce at dp = 2 on Gloo (CPU), and the share of
the gradient communication that overlap hides.

    python benchmarks/bench_overlap.py [--layers 8 --hidden 256 --seq 32 --iters 20]

Both ranks train the same GPT (one process per data-parallel rank, one thread each). For each mode
the median iteration time over `--iters` timed iterations (after warm-up) is reported;
t_comm is the time of all-reducing buffers of the same bucket sizes alone, so
hidden share = (t_no_overlap - t_overlap) / t_comm.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import ScheduleConfig, forward_backward

VOCAB = 1024


def make_config(args: argparse.Namespace, overlap: bool, distributed: bool) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 8
    m.seq_length = m.max_position_embeddings = args.seq
    m.hidden_dropout = m.attention_dropout = 0.0
    m.padded_vocab_size = VOCAB
    p = cfg.parallel
    p.overlap_grad_reduce = overlap
    p.use_distributed_optimizer = distributed
    p.ddp_bucket_size = args.bucket_size
    cfg.optimizer.lr = 1e-4
    return cfg


MODES = [
    ("ddp", False, False),
    ("ddp --overlap-grad-reduce", True, False),
    ("distopt", False, True),
    ("distopt --overlap-grad-reduce", True, True),
]


def build_mode(args, pctx: ParallelContext, overlap: bool, distributed: bool):
    cfg = make_config(args, overlap, distributed)
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel)
    return chunk, build_optimizer(cfg, [chunk], pctx)


def time_iteration(args, pctx: ParallelContext, chunk, optimizer, g: torch.Generator) -> float:
    mb = args.micro_batch
    positions = torch.arange(args.seq).expand(mb, args.seq)
    schedule_cfg = ScheduleConfig(seq_length=args.seq, micro_batch_size=mb, hidden_size=args.hidden)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        output = model(tokens, positions, None, tokens)
        return output, lambda out: (out.sum(), torch.tensor(float(out.numel())), {})

    data = [torch.randint(0, VOCAB, (mb, args.seq), generator=g) for _ in range(args.micro)]
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    forward_backward(forward_step, iter(data), [chunk], args.micro, pctx, schedule_cfg)
    finalize_model_grads([chunk], pctx)
    optimizer.step()
    return time.perf_counter() - start


def time_comm(bucket_sizes: list[int], repeats: int, sharded: bool) -> float:
    """Median time of the gradient collectives of one iteration alone (no compute): an
    all-reduce per bucket, or a reduce-scatter and an all-gather per bucket (sharded)."""
    buffers = [torch.randn(n) for n in bucket_sizes]
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        for buffer in buffers:
            if sharded:
                shard = buffer[: buffer.numel() // 2].clone()
                dist.reduce_scatter_single(shard, buffer)
                dist.all_gather_single(buffer, shard)
            else:
                dist.all_reduce(buffer)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def worker(rank: int, world_size: int, args: argparse.Namespace, out: str) -> None:
    pctx = ParallelContext.from_sizes()
    setups = {name: build_mode(args, pctx, o, d) for name, o, d in MODES}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {name: [] for name in setups}
    # Modes take turns, iteration by iteration, so that load changes on the machine hit all alike.
    for round_index in range(args.warmup + args.iters):
        for name, (chunk, optimizer) in setups.items():
            elapsed = time_iteration(args, pctx, chunk, optimizer, g)
            if round_index >= args.warmup:
                times[name].append(elapsed)
    rows = {name: statistics.median(values) for name, values in times.items()}
    ddp_sizes = [b.numel for b in setups["ddp"][0].buckets]
    dist_sizes = [b.numel for b in setups["distopt"][0].buckets]
    t_comm = {
        "ddp": time_comm(ddp_sizes, args.iters, sharded=False),
        "distopt": time_comm(dist_sizes, args.iters, sharded=True),
    }
    if rank == 0:
        torch.save({"rows": rows, "t_comm": t_comm, "buckets": ddp_sizes}, Path(out) / "r.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro", type=int, default=1, help="micro-batches per iteration")
    parser.add_argument("--bucket-size", type=int, default=1_000_000)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        run_distributed(worker, 2, args, out)
        result = torch.load(Path(out) / "r.pt", weights_only=True)
    rows, t_comm = result["rows"], result["t_comm"]
    n_params = sum(result["buckets"])
    print(
        f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch "
        f"{args.micro_batch} x {args.micro}; {n_params / 1e6:.1f}M gradient elements in "
        f"{len(result['buckets'])} buckets of <= ~{args.bucket_size / 1e6:g}M; dp = 2, Gloo\n"
    )
    print("| mode | iteration time (s) | vs no overlap |")
    print("|---|---|---|")
    for name, value in rows.items():
        base = rows["distopt" if name.startswith("distopt") else "ddp"]
        print(f"| {name} | {value:.3f} | {value / base:.2f} |")
    print()
    print("| family | t_no_overlap - t_overlap (s) | t_comm alone (s) | share hidden |")
    print("|---|---|---|---|")
    for family in ("ddp", "distopt"):
        saved = rows[family] - rows[f"{family} --overlap-grad-reduce"]
        print(
            f"| {family} | {saved:.3f} | {t_comm[family]:.3f} | "
            f"{100 * saved / t_comm[family]:.0f}% |"
        )


if __name__ == "__main__":
    main()
