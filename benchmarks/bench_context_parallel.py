"""Context parallelism on CPU/Gloo: memory per rank of one training step at cp = 1, 2, 4, and the
share of the ring's communication that overlapping hides.

    python benchmarks/bench_context_parallel.py [--layers 8 --hidden 256 --seq 8192 --cps 1 2 4]

Memory: each cp size runs in its own fresh processes (one per rank, one thread each) and trains a
GPT (RoPE, 8 heads) for one step at micro-batch 1 with `--cp-comm-type p2p`. Per rank:
- activations: bytes of the distinct storages autograd holds for the backward at the end of the
  forward pass (saved-tensor hooks; parameters excluded): the activation memory;
- params + grads + optimizer state (optim.memory.memory_bytes_per_rank): replicated over cp;
- peak RSS growth of the process over the step (getrusage; allocator caching included).
Goal: activations(cp) <= activations(1) / cp.

Overlap: the ring attention alone (forward + backward, sequence `--seq`, the model's heads) at
each cp, run overlapped (the next block's transfer posted before the current block's compute) and
serial (the same ring with every transfer waited for as soon as it is posted), in turns.
"blocked" is the time a rank waited on transfers (stats["comm_wait_s"]); hidden share =
1 - blocked(overlapped) / blocked(serial). "transfers alone" times the same messages (forward: N-1
key/value exchanges; backward: N-1 key/value and N gradient exchanges) without compute. At cp = 1
the ring (one block, no transfers) is timed against plain SDPA: the cost of the machinery.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gigatron.config.root import GigatronConfig
from gigatron.families import get_family
from gigatron.optim import build_optimizer
from gigatron.optim.memory import memory_bytes_per_rank
from gigatron.parallel import context_parallel as cpm
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads

VOCAB = 1024
HEADS = 8


# ---- memory of one training step -----------------------------------------------------------


def _config(args: argparse.Namespace, cp: int) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, HEADS
    m.seq_length = args.seq
    m.position_embedding_type = "rope"
    m.hidden_dropout = m.attention_dropout = 0.0
    m.padded_vocab_size = VOCAB
    cfg.parallel.context_parallel_size = cp
    cfg.parallel.cp_comm_type = ["p2p"]
    cfg.optimizer.lr = 1e-4
    return cfg


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class SavedActivations:
    """Bytes of the distinct storages autograd saves for the backward, parameters excluded."""

    def __init__(self, params) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.param_storages:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def memory_worker(rank: int, world_size: int, args: argparse.Namespace, out: str) -> None:
    pctx = ParallelContext.from_sizes(cp=world_size)
    cfg = _config(args, world_size)
    family = get_family("gpt")
    (model,) = family.build_model(cfg, pctx, VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel)
    optimizer = build_optimizer(cfg, [chunk], pctx)
    forward_step = family.make_forward_step(cfg, pctx)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, args.seq + 1), generator=generator)
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(1, args.seq),
        "position_ids": torch.arange(args.seq).unsqueeze(0),
    }
    rss_before, peak_before = _current_rss(), _peak_rss()
    saved = SavedActivations(model.parameters())
    start = time.perf_counter()
    optimizer.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        output, loss_fn = forward_step(iter([batch]), chunk)
        loss, num_tokens, _ = loss_fn(output)
    (loss / num_tokens).backward()
    finalize_model_grads([chunk], pctx)
    optimizer.step()
    elapsed = time.perf_counter() - start
    result = {
        "activations": saved.total,
        "state": memory_bytes_per_rank([chunk], optimizer)["total"],
        "rss_growth": _peak_rss() - max(rss_before, peak_before),
        "rss_peak": _peak_rss(),
        "step_s": elapsed,
    }
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, Path(out) / f"memory_{world_size}.pt")


def report_memory(args: argparse.Namespace, out: str) -> None:
    print(
        f"Memory per rank, one training step: GPT {args.layers} layers, RoPE, vocab {VOCAB}, "
        "--cp-comm-type p2p (max over ranks)\n"
    )
    print(
        "| cp | activations (MiB) | x cp / cp=1 | params+grads+Adam (MiB) | peak RSS growth "
        "(MiB) | peak RSS (MiB) | step (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    base = None
    for cp in args.cps:
        run_distributed(memory_worker, cp, args, out)
        rows = torch.load(Path(out) / f"memory_{cp}.pt", weights_only=False)
        worst = {key: max(row[key] for row in rows) for key in rows[0]}
        base = base or worst["activations"] * cp
        mib = 2**20
        print(
            f"| {cp} | {worst['activations'] / mib:.0f} | {worst['activations'] * cp / base:.3f} "
            f"| {worst['state'] / mib:.1f} | {worst['rss_growth'] / mib:.0f} | "
            f"{worst['rss_peak'] / mib:.0f} | {worst['step_s']:.1f} |"
        )
    print()


# ---- overlap of the ring ----------------------------------------------------------------------


def _exchanges_alone(kv: torch.Tensor, dkv: torch.Tensor, pctx: ParallelContext) -> float:
    """The ring's transfers of one forward + backward, without compute."""
    ring = cpm.Ring.of(pctx)
    n = ring.size
    start = time.perf_counter()
    for tensor, count, to, source in (
        (kv, n - 1, ring.next_rank, ring.prev_rank),  # forward
        (kv, n - 1, ring.prev_rank, ring.next_rank),  # backward: blocks
        (dkv, n, ring.prev_rank, ring.next_rank),  # backward: gradient accumulators
    ):
        spare = torch.empty_like(tensor)
        for _ in range(count):
            cpm._Exchange(ring, tensor, spare, to, source, 0, None).wait()
    return time.perf_counter() - start


class _SerialExchange(cpm._Exchange):
    """The ring's exchange, waited for at once: the same ring without overlap."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.wait()


def _ring_step(q, k, v, pctx, stats) -> float:
    dist.barrier()
    start = time.perf_counter()
    out = cpm.ring_attention(q, k, v, pctx, causal=True, scale=q.shape[-1] ** -0.5, stats=stats)
    out.sum().backward()
    return time.perf_counter() - start


def overlap_worker(rank: int, world_size: int, args: argparse.Namespace, out: str) -> None:
    pctx = ParallelContext.from_sizes(cp=world_size)
    sl, dim = args.seq // world_size, args.hidden // HEADS
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (
        torch.randn(sl, 1, HEADS, dim, generator=generator).requires_grad_() for _ in range(3)
    )
    series: dict[str, list[float]] = {
        "overlap": [], "serial": [], "alone": [], "compute": [], "blocked": [],
        "blocked_serial": [],
    }  # fmt: skip
    if world_size == 1:
        series = {"overlap": [], "compute": [], "sdpa": []}
    overlapped = cpm._Exchange
    for repeat in range(args.warmup + args.repeats):
        # The variants take turns so that changing load on the machine hits all alike.
        times: dict[str, float] = {}
        stats: dict[str, float] = {}
        times["overlap"] = _ring_step(q, k, v, pctx, stats)
        times["compute"] = stats["compute_s"]
        if world_size > 1:
            times["blocked"] = stats["comm_wait_s"]
        if world_size == 1:  # the plain fused attention, for the cost of the machinery
            start = time.perf_counter()
            qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).sum().backward()
            times["sdpa"] = time.perf_counter() - start
        else:
            cpm._Exchange = _SerialExchange
            serial_stats: dict[str, float] = {}
            try:
                times["serial"] = _ring_step(q, k, v, pctx, serial_stats)
            finally:
                cpm._Exchange = overlapped
            times["blocked_serial"] = serial_stats["comm_wait_s"]
            dist.barrier()
            block = torch.empty(2, sl, 1, HEADS, dim)
            times["alone"] = _exchanges_alone(block, block.clone(), pctx)
        if repeat >= args.warmup:
            for key, value in times.items():
                series[key].append(value)
    row = {name: statistics.median(values) for name, values in series.items()}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, row)
    if rank == 0:
        torch.save(gathered, Path(out) / f"overlap_{world_size}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--part", choices=["memory", "overlap", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    print(
        f"seq {args.seq}, hidden {args.hidden}, {HEADS} heads, micro-batch 1; Gloo, one thread "
        "per rank\n"
    )
    with tempfile.TemporaryDirectory() as out:
        if args.part in ("memory", "both"):
            report_memory(args, out)
        if args.part in ("overlap", "both"):
            report_overlap(args, out)


def report_overlap(args: argparse.Namespace, out: str) -> None:
    print(
        "Ring attention alone, forward + backward (mean over ranks of the medians). Blocked: "
        "time the rank waited on transfers, with the next block's transfer posted before the "
        "compute (overlapped) and waited for at once (serial).\n"
    )
    print(
        "| cp | fwd+bwd overlapped (s) | fwd+bwd serial (s) | transfers alone (s) | blocked, "
        "overlapped (s) | blocked, serial (s) | hidden = 1 - blocked ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for cp in args.cps:
        run_distributed(overlap_worker, cp, args, out)
        rows = torch.load(Path(out) / f"overlap_{cp}.pt", weights_only=False)
        mean = {key: statistics.mean(row[key] for row in rows) for key in rows[0]}
        if cp == 1:
            print(
                f"| 1 | {mean['overlap']:.3f} (plain SDPA {mean['sdpa']:.3f}: ratio "
                f"{mean['overlap'] / mean['sdpa']:.2f}) | - | - | - | - | - |"
            )
            continue
        hidden = 1.0 - mean["blocked"] / mean["blocked_serial"]
        print(
            f"| {cp} | {mean['overlap']:.3f} | {mean['serial']:.3f} | {mean['alone']:.3f} | "
            f"{mean['blocked']:.3f} | {mean['blocked_serial']:.3f} | {100 * hidden:.0f}% |"
        )
    print()


if __name__ == "__main__":
    main()
