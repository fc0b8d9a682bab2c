"""Benchmark the context-parallel split of packed SFT samples: the attention work of each cp
rank under the whole-sequence split and under the split per document.

The instruction set is bench_sft_packing.py's (RACE questions and LAMBADA passages from
tests/data), packed by `--sft-pack-sequences` at --seq-length for --context-parallel-size N:
with N > 1 each conversation is padded to a multiple of 2N (what the split per document needs).
For every packed sample and cp rank it counts the attention scores the rank's queries compute
under the sample's mask (query-key pairs inside a conversation, causal: the work of any exact
attention kernel that skips hidden blocks), with the rank's positions taken either by the
whole-sequence split (chunks r and 2N-1-r of the sample) or by the split per document
(`document_split_order`: chunks r and 2N-1-r of every conversation). A step waits for its
slowest rank, so the figure to read is the slowest rank's work over the mean (1.00 = balanced).
Counting only: nothing is trained, so the figures do not depend on the machine.

    python benchmarks/bench_cp_document_split.py [--seq-length 1024] [--cp 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench_sft_packing import flags, lambada_pairs, race_pairs, train_dataset
from gigatron.data.tokenizers import build_tokenizer
from gigatron.parallel.context_parallel import (
    cp_rank_positions,
    document_split_order,
    split_for_cp_rank,
)
from gigatron.training.pretrain import parse_pretrain_config


def rank_work(sample: dict, cp: int, per_document: bool) -> list[int]:
    """Visible query-key pairs of each cp rank's queries in one packed sample."""
    visible = ~torch.from_numpy(sample["attention_mask"][0])  # [s, s], True = attended
    seq = visible.shape[0]
    starts = torch.from_numpy(sample["document_start"])[None]
    order = document_split_order(starts, cp)[0] if per_document else torch.arange(seq)
    work = []
    for rank in range(cp):
        if per_document:
            queries = split_for_cp_rank(order[None], 1, cp, rank)[0]
        else:
            queries = cp_rank_positions(seq, cp, rank)
        work.append(int(visible[queries].sum()))
    return work


def imbalance(dataset, cp: int, per_document: bool) -> tuple[float, float]:
    """(mean over samples of slowest / mean rank work, total slowest / total mean)."""
    ratios, slowest, mean = [], 0, 0.0
    for index in range(len(dataset)):
        work = rank_work(dataset[index], cp, per_document)
        ratios.append(max(work) / (sum(work) / cp))
        slowest += max(work)
        mean += sum(work) / cp
    return sum(ratios) / len(ratios), slowest / mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--lambada", type=int, default=20)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "instructions.jsonl"
        rows = race_pairs() + lambada_pairs(args.lambada)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{len(rows)} conversations, seq length {args.seq_length}\n")
        print("| cp | packed samples | fill ratio | whole-sequence split: slowest / mean rank "
              "(per sample, overall) | split per document |")  # fmt: skip
        print("|---|---|---|---|---|")
        for cp in args.cp:
            argv = flags(data, args.seq_length, True) + ["--context-parallel-size", str(cp)]
            cfg = parse_pretrain_config(argv, world_size=cp)
            dataset = train_dataset(cfg, build_tokenizer(cfg.tokenizer))
            whole = imbalance(dataset, cp, False)
            split = imbalance(dataset, cp, True)
            print(
                f"| {cp} | {len(dataset)} | {100 * dataset.packing.fill_ratio:.1f}% | "
                f"{whole[0]:.3f}, {whole[1]:.3f} | {split[0]:.3f}, {split[1]:.3f} |"
            )


if __name__ == "__main__":
    main()
