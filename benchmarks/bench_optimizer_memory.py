"""Bytes per parameter held by each rank, measured from tensor storages, for the plain and the
distributed optimizer at d = 1, 2, 4 data-parallel ranks (spawned Gloo processes), next to
Megatron-LM's table.

    python benchmarks/bench_optimizer_memory.py [--layers 2 --hidden 256]

Each configuration takes one training step (so the optimizer state exists) and then counts the
unique storages of parameters, gradient buffers, fp32 main params / gradient copies and the Adam
moments (`gigatron.optim.distributed_optimizer.memory_bytes_per_rank`); the largest rank is shown.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from gigatron.config.root import GigatronConfig
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.optim.memory import memory_bytes_per_rank
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel

VOCAB = 1024
# Megatron-LM's table: (plain, distributed a, b) with distributed = a + b / d.
ROWS = {
    "fp16 params, fp16 grads": ("fp16", torch.float16, 20, 4, 16),
    "bf16 params, fp32 grads": ("bf16", torch.float32, 18, 6, 12),
    "fp32 params, fp32 grads": ("fp32", torch.float32, 16, 8, 8),
}


def measure(args, pctx: ParallelContext, precision: str, grad_dtype, distributed: bool) -> float:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 4
    m.seq_length = m.max_position_embeddings = 32
    m.padded_vocab_size = VOCAB
    cfg.parallel.use_distributed_optimizer = distributed
    cfg.training.fp16 = precision == "fp16"
    cfg.training.bf16 = precision == "bf16"
    cfg.training.initial_loss_scale = 2.0**10  # no fp16 overflow: the step must allocate state
    cfg.optimizer.lr = 1e-4
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=grad_dtype)
    optimizer = build_optimizer(cfg, [chunk], pctx)
    tokens = torch.randint(0, VOCAB, (1, 32))
    loss = chunk(tokens, torch.arange(32).unsqueeze(0)).float().mean()  # logits: any loss
    optimizer.scale_loss(loss).backward()
    chunk.finish_grad_sync()
    success, _, _ = optimizer.step()
    assert success, "the measured step was skipped; its optimizer state would be missing"
    numel = sum(p.numel() for p in model.parameters())
    per_param = torch.tensor([memory_bytes_per_rank([chunk], optimizer)["total"] / numel])
    pctx.all_reduce(per_param, "dp", op=torch.distributed.ReduceOp.MAX)
    return float(per_param)


def worker(rank: int, world_size: int, args, out: str) -> None:
    pctx = ParallelContext.from_sizes()
    results = {}
    for name, (precision, grad_dtype, *_rest) in ROWS.items():
        results[name] = {
            "plain": measure(args, pctx, precision, grad_dtype, distributed=False),
            "distributed": measure(args, pctx, precision, grad_dtype, distributed=True),
        }
    if rank == 0:
        torch.save(results, Path(out) / f"d{world_size}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    sizes = (1, 2, 4)
    with tempfile.TemporaryDirectory() as out:
        for d in sizes:
            run_distributed(worker, d, args, out)
        results = {d: torch.load(Path(out) / f"d{d}.pt", weights_only=True) for d in sizes}
    print(f"GPT {args.layers} layers, hidden {args.hidden}, vocab {VOCAB}; Adam; bytes/param\n")
    header = " | ".join(f"distributed d={d} (Megatron)" for d in sizes)
    print(f"| precision | plain (Megatron) | {header} |")
    print("|---|---|" + "---|" * len(sizes))
    for name, (_, _, plain, a, b) in ROWS.items():
        cells = [f"{results[1][name]['plain']:.2f} ({plain})"]
        cells += [f"{results[d][name]['distributed']:.2f} ({a + b / d:g})" for d in sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
