"""Bytes per parameter of the optimizer state for each state precision and offload setting,
measured from tensor storages after one step (one process, --bf16 model, fp32 gradients).

    python benchmarks/bench_optimizer_state_precision.py [--layers 2 --hidden 256]

Columns: the whole rank (`memory_bytes_per_rank`: parameters + gradients + main parameters +
state), the optimizer state alone, and how much of it stays on the device when the state of the
offloaded parameters lives on the host (`--optimizer-cpu-offload`).
"""

from __future__ import annotations

import argparse

import torch

from gigatron.config.root import GigatronConfig
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.optim.memory import memory_bytes_per_rank
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.data_parallel import DistributedDataParallel

VOCAB = 1024
SETTINGS = {
    "AdamW (torch), fp32 moments": {},
    "precision-aware, fp32 moments": {"use_precision_aware_optimizer": True},
    "bf16 exp_avg + bf16 exp_avg_sq": {
        "use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"
    },
    "fp16 exp_avg + bf16 exp_avg_sq": {
        "use_precision_aware_optimizer": True, "exp_avg_dtype": "fp16", "exp_avg_sq_dtype": "bf16"
    },
    "bf16 moments, offload 0.5": {
        "use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16",
        "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5,
    },
    "fp32 moments, offload 1.0": {
        "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True,
    },
    "Muon (momentum) + AdamW (rest)": {"optimizer": "muon"},
}  # fmt: skip


def measure(args, settings: dict) -> tuple[float, float, float]:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 4
    m.seq_length = m.max_position_embeddings = 32
    m.padded_vocab_size = VOCAB
    cfg.training.bf16 = True
    cfg.optimizer.lr = 1e-4
    for key, value in settings.items():
        setattr(cfg.optimizer, key, value)
    pctx = ParallelContext.single()
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=torch.float32)
    optimizer = build_optimizer(cfg, [chunk], pctx)
    tokens = torch.randint(0, VOCAB, (1, 32))
    chunk(tokens, torch.arange(32).unsqueeze(0)).float().mean().backward()
    optimizer.step()
    numel = sum(p.numel() for p in model.parameters())
    measured = memory_bytes_per_rank([chunk], optimizer)
    inner = optimizer.optimizer
    offloaded = getattr(inner, "offloaded", set())
    host = sum(
        value.untyped_storage().nbytes()
        for param, state in inner.state.items()
        if id(param) in offloaded
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    state = measured["optimizer_state"]
    return measured["total"] / numel, state / numel, (state - host) / numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    print("| setting | total bytes/param | optimizer state | of it on the device |")
    print("|---|---|---|---|")
    for name, settings in SETTINGS.items():
        total, state, device = measure(args, settings)
        print(f"| {name} | {total:.2f} | {state:.2f} | {device:.2f} |")


if __name__ == "__main__":
    main()
