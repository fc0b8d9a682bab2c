"""µP's learning-rate transfer: sweep --lr at two widths, with and without --use-mup, and print
the final training loss of each (the mean of the last 5 steps), as a markdown table.

Byte-level language modelling (vocabulary 256) of tests/data/wikitext-2-wiki.test.tokens with a
2-layer GPT (16 channels per head, RMSNorm, RoPE, untied output layer), Adam, constant lr after
a 5-step warm-up, the same batches at every width; µP's base width is the narrow one.

    python benchmarks/bench_mup_transfer.py [--widths 64 256 --steps 60 --batch 8 --seq 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gigatron.config.root import parse_config
from gigatron.families import get_family
from gigatron.optim.build import build_optimizer
from gigatron.optim.lr_schedule import build_lr_scheduler
from gigatron.parallel.context import ParallelContext

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "wikitext-2-wiki.test.tokens"
VOCAB = 256


def batches(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    """`steps` batches [batch, seq + 1] of bytes at random offsets (one fixed generator)."""
    data = torch.frombuffer(bytearray(TEXT.read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        out.append(torch.stack([data[s : s + seq + 1] for s in starts.tolist()]))
    return out


def train(width: int, base: int, mup: bool, lr: float, data: list[torch.Tensor]) -> float:
    """Mean loss of the last 5 steps of a run over `data`."""
    batch, seq = data[0].shape[0], data[0].shape[1] - 1
    argv = ["--num-layers", "2", "--hidden-size", str(width), "--num-attention-heads",
            str(width // 16), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--vocab-size", str(VOCAB), "--position-embedding-type", "rope", "--normalization",
            "RMSNorm", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--lr", str(lr), "--lr-decay-style", "constant",
            "--lr-warmup-iters", "5", "--train-iters", str(len(data)), "--micro-batch-size",
            str(batch), "--global-batch-size", str(batch), "--weight-decay", "0"]  # fmt: skip
    if mup:
        argv += ["--use-mup", "--mup-base-hidden-size", str(base)]
    cfg = parse_config(argv)
    torch.manual_seed(0)
    chunks = get_family("gpt").build_model(cfg, ParallelContext.single(), VOCAB)
    optimizer = build_optimizer(cfg, chunks, ParallelContext.single())
    schedule = build_lr_scheduler(cfg, optimizer)
    losses = []
    for tokens in data:
        schedule.step(batch)
        logits = chunks[0](tokens[:, :-1], None)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item() if torch.isfinite(loss) else float("inf"))
    return sum(losses[-5:]) / 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--widths", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = batches(args.steps, args.batch, args.seq)
    base = args.widths[0]
    print(
        "| parametrization | width | "
        + " | ".join(f"lr {lr:g}" for lr in args.lrs)
        + " | best lr |"
    )
    print("|---" * (len(args.lrs) + 3) + "|")
    for mup in (True, False):
        for width in args.widths:
            losses = [train(width, base, mup, lr, data) for lr in args.lrs]
            best = args.lrs[losses.index(min(losses))]
            cells = " | ".join(f"{loss:.3f}" for loss in losses)
            print(f"| {'µP' if mup else 'standard'} | {width} | {cells} | {best:g} |", flush=True)


if __name__ == "__main__":
    main()
