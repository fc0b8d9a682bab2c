"""Bytes per parameter held by each rank with fully sharded data parallelism (PyTorch FSDP2,
`--use-torch-fsdp2`) at d = 1, 2, 4 data-parallel ranks (spawned Gloo processes), next to the
distributed optimizer's figures measured the same way.

    python benchmarks/bench_fsdp_memory.py [--layers 2 --hidden 256]

Each configuration takes one training step (so Adam's state exists), then counts the unique
storages this rank holds between steps (`gigatron.optim.memory.memory_bytes_per_rank`: a DTensor
counts its local shard); the largest rank is shown. At d = 1 FSDP shards nothing and the run is
the plain optimizer's (DistributedDataParallel).
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
from gigatron.parallel.fully_sharded import FullyShardedDataParallel

VOCAB = 1024
# precision -> (--bf16, gradient / reduce dtype)
ROWS = {
    "bf16 params, fp32 grads": (True, torch.float32),
    "bf16 params, bf16 grads (--grad-reduce-in-bf16)": (True, torch.bfloat16),
    "fp32 params, fp32 grads": (False, torch.float32),
}


def measure(args, pctx: ParallelContext, bf16: bool, grad_dtype, mode: str) -> float:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 4
    m.seq_length = m.max_position_embeddings = 32
    m.padded_vocab_size = VOCAB
    cfg.training.bf16 = bf16
    cfg.optimizer.lr = 1e-4
    cfg.parallel.use_distributed_optimizer = mode == "distributed"
    cfg.parallel.use_torch_fsdp2 = mode == "fsdp"
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    numel = sum(p.numel() for p in model.parameters())
    if mode == "fsdp" and pctx.dp_size > 1:
        dtype = torch.bfloat16 if bf16 else torch.float32
        chunk = FullyShardedDataParallel(model, pctx, cfg.parallel, dtype, grad_dtype)
    else:
        chunk = DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=grad_dtype)
    optimizer = build_optimizer(cfg, [chunk], pctx)
    tokens = torch.randint(0, VOCAB, (1, 32))
    loss = chunk(tokens, torch.arange(32).unsqueeze(0)).float().mean()
    optimizer.scale_loss(loss).backward()
    chunk.finish_grad_sync()
    success, _, _ = optimizer.step()
    assert success
    per_param = torch.tensor([memory_bytes_per_rank([chunk], optimizer)["total"] / numel])
    pctx.all_reduce(per_param, "dp", op=torch.distributed.ReduceOp.MAX)
    return float(per_param)


def worker(rank: int, world_size: int, args, out: str) -> None:
    pctx = ParallelContext.from_sizes()
    results = {
        name: {mode: measure(args, pctx, bf16, grad, mode) for mode in ("distributed", "fsdp")}
        for name, (bf16, grad) in ROWS.items()
    }
    if rank == 0:
        torch.save(results, Path(out) / f"d{world_size}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    sizes = (1, 2, 4)
    with tempfile.TemporaryDirectory() as out:
        for d in sizes:
            run_distributed(worker, d, args, out)
        results = {d: torch.load(Path(out) / f"d{d}.pt", weights_only=True) for d in sizes}
    print(f"GPT {args.layers} layers, hidden {args.hidden}, vocab {VOCAB}; Adam; bytes/param\n")
    header = " | ".join(f"d={d} distributed / FSDP2" for d in sizes)
    print(f"| precision | {header} |")
    print("|---|" + "---|" * len(sizes))
    for name in ROWS:
        cells = [
            f"{results[d][name]['distributed']:.2f} / {results[d][name]['fsdp']:.2f}" for d in sizes
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
