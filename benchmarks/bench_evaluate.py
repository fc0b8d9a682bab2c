"""Evaluation throughput against the training forward pass, side by side on one model.

`score_samples` (what `gigatron evaluate` and the lm-eval adapter run) against the family's own
forward step through the schedule with forward_only=True (what validation during training runs),
on the same windows. Both are batched forward passes plus the vocab-parallel loss; the ratio shows
the cost of the scoring's extra bookkeeping (greedy matches, per-sample sums, padding).

    python benchmarks/bench_evaluate.py [--layers 4 --hidden 256 --vocab 8192 --seq 256 --batches 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gigatron.config.root import GigatronConfig
from gigatron.families import get_family
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.schedules import ScheduleConfig, forward_backward
from gigatron.tasks.scoring import Sample, score_samples


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--layers", type=int, default=4, help="layers (default: 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (default: 8192)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (default: 256)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size (default: 8)")
    parser.add_argument("--batches", type=int, default=20, help="micro-batches (default: 20)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats (default: 3)")
    args = parser.parse_args()

    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 4
    m.seq_length = m.max_position_embeddings = args.seq
    m.hidden_dropout = m.attention_dropout = 0.0
    from gigatron.config.validate import finalize_config

    finalize_config(cfg, world_size=1)
    pctx = ParallelContext.single()
    chunks = build_model(cfg, pctx, vocab_size=args.vocab)
    for chunk in chunks:
        chunk.eval()
    rng = np.random.default_rng(0)
    n = args.batch * args.batches
    tokens = rng.integers(0, args.vocab, size=(n, args.seq + 1))
    samples = [Sample(row, np.ones(args.seq, dtype=np.float32)) for row in tokens]
    batches = [
        {
            "tokens": tokens[i : i + args.batch, :-1],
            "labels": tokens[i : i + args.batch, 1:],
            "loss_mask": np.ones((args.batch, args.seq), dtype=np.float32),
            "position_ids": np.tile(np.arange(args.seq), (args.batch, 1)),
        }
        for i in range(0, n, args.batch)
    ]
    step = get_family("gpt").make_forward_step(cfg, pctx)
    config = ScheduleConfig(args.seq, args.batch, args.hidden)

    def training_forward() -> None:
        with torch.no_grad():
            forward_backward(step, iter(batches), chunks, len(batches), pctx, config, True)

    def evaluation() -> None:
        score_samples(chunks, pctx, samples, args.batch, seq_length=args.seq)

    times: dict[str, list[float]] = {"training forward": [], "evaluation scoring": []}
    training_forward()  # warm-up
    for _ in range(args.repeats):
        for name, run in (
            ("training forward", training_forward),
            ("evaluation scoring", evaluation),
        ):
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    reference = min(times["training forward"])
    print(f"{n} sequences x {args.seq} tokens, {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}; best of {args.repeats} (CPU seconds)")  # fmt: skip
    for name, values in times.items():
        best = min(values)
        print(f"| {name} | {best:.2f} | {n * args.seq / best:,.0f} | {reference / best:.2f} |")


if __name__ == "__main__":
    main()
