"""Overhead of gigatron's training loop against a plain PyTorch loop on the same model and data.

Candidate: `gigatron.training.pretrain.pretrain` (DistributedDataParallel gradient buffer,
schedule, gradient finalisation, optimizer wrapper, LR schedule, metrics). Reference: the same
GPT chunk from `build_model`, the same micro-batches, `torch.optim.AdamW`, and a hand-written
accumulate-then-step loop. Both run in this process, one after the other, on one thread.
Prints a markdown table: median milliseconds per iteration and the ratio, and the first-iteration
losses of both (they must agree: same weights, same data).

    python benchmarks/bench_training_loop.py [--iters 30] [--hidden-size 128] [--num-layers 4]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def flags(args: argparse.Namespace, save: str) -> list[str]:
    return [
        "--mock-data", "--vocab-size", "1024", "--num-layers", str(args.num_layers),
        "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(2 * args.micro_batch_size), "--lr", "1e-3",
        "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0",
        "--train-iters", str(args.iters), "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--no-progress-bar", "--metrics-file", str(Path(save) / "metrics.jsonl"),
        "--device", "cpu",
    ]  # fmt: skip


def run_gigatron(args: argparse.Namespace, save: str) -> tuple[list[float], float]:
    from gigatron.training.pretrain import parse_pretrain_config, pretrain

    cfg = parse_pretrain_config(flags(args, save), world_size=1)
    pretrain(cfg, stream=io.StringIO())
    records = [json.loads(line) for line in open(Path(save) / "metrics.jsonl")]
    train = [r for r in records if r["type"] == "train"]
    return [1000 * r["iteration_time_s"] for r in train[2:]], train[0]["lm_loss"]


def run_plain(args: argparse.Namespace, save: str) -> tuple[list[float], float]:
    from gigatron.data.gpt_dataset import build_gpt_datasets
    from gigatron.data.loader import build_data_iterator
    from gigatron.data.tokenizers import build_tokenizer
    from gigatron.families.gpt import token_losses
    from gigatron.models import build_model
    from gigatron.parallel.context import ParallelContext
    from gigatron.parallel.random import seed_everything
    from gigatron.training.pretrain import parse_pretrain_config

    cfg = parse_pretrain_config(flags(args, save), world_size=1)
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    pctx = ParallelContext.single()
    seed_everything(cfg.training.seed, pctx)
    tokenizer = build_tokenizer(cfg.tokenizer)
    (model,) = build_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    train_ds, _, _ = build_gpt_datasets(
        cfg, tokenizer, (args.iters * 2 * args.micro_batch_size, None, None)
    )
    data = build_data_iterator(train_ds, args.micro_batch_size, 0, pctx)
    times, first_loss = [], None
    for _ in range(args.iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_sum, tokens = 0.0, 0.0
        for _ in range(2):
            batch = next(data)
            losses = token_losses(
                model(batch["tokens"], batch["position_ids"]), batch["labels"], pctx
            )
            mask = batch["loss_mask"].float()
            total = (losses.float() * mask).sum()
            (total / mask.sum() / 2).backward()
            loss_sum += total.item()
            tokens += mask.sum().item()
        optimizer.step()
        times.append(1000 * (time.perf_counter() - start))
        if first_loss is None:
            first_loss = loss_sum / tokens
    return times[2:], first_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        plain_ms, plain_loss = run_plain(args, a)
        giga_ms, giga_loss = run_gigatron(args, b)
    plain, giga = statistics.median(plain_ms), statistics.median(giga_ms)
    shape = (
        f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
        f"2 x {args.micro_batch_size} samples/iter"
    )
    print("| model | plain PyTorch loop (ms/iter) | gigatron loop (ms/iter) | ratio | "
          "iteration-1 loss (plain / gigatron) |")  # fmt: skip
    print("|---|---|---|---|---|")
    print(f"| {shape} | {plain:.1f} | {giga:.1f} | {giga / plain:.2f} | "
          f"{plain_loss:.6f} / {giga_loss:.6f} |")  # fmt: skip


if __name__ == "__main__":
    main()
