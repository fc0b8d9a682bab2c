"""Benchmark the GPT dataset: index building, blending, and random-access sample reads.

Side by side in one run:
  1. sample index for --tokens tokens (documents of log-normal lengths, mean ~600 tokens) at
     --seq-length: gigatron's numpy build vs the plain-Python walk of the same algorithm (the
     walk is timed on --walk-tokens tokens and scaled linearly to --tokens);
  2. blending indices for --blend-samples samples: the block-verified numpy build vs the plain
     one-sample-at-a-time loop, for two and three datasets;
  3. random-access reads of --reads samples from a dataset of --tokens tokens written to disk
     with IndexedDatasetBuilder (uint16): GPTDataset.__getitem__ (tokens, labels, masks) vs the
     floor of reading seq_length + 1 contiguous tokens at random offsets of the raw .bin memmap.
     The file has just been written, so reads hit the page cache.
Prints markdown tables.

    python benchmarks/bench_dataset.py [--tokens 100000000] [--seq-length 2048]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from gigatron.data.blend import _greedy_python, build_blending_indices
from gigatron.data.gpt_dataset import GPTDataset, GPTDatasetOptions
from gigatron.data.indexed import IndexedDataset, IndexedDatasetBuilder
from gigatron.data.sample_index import build_all_indices, build_sample_index


def reference_sample_index(lengths, document_index, seq_length, num_epochs, tokens_per_epoch):
    """The plain-Python walk (as in tests/unit/test_sample_index.py): one step per document."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    rows = [(0, 0)]
    position, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            available = int(lengths[document_index[position]]) - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows)


def document_lengths(total_tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.RandomState(seed)
    lengths = np.maximum(1, rng.lognormal(mean=6.0, sigma=1.0, size=total_tokens // 300))
    lengths = lengths.astype(np.int64)
    cut = int(np.searchsorted(np.cumsum(lengths), total_tokens))
    lengths = lengths[: cut + 1]
    lengths[-1] -= int(lengths.sum()) - total_tokens
    return lengths[lengths > 0].astype(np.int32)


def timed(fn, *args, repeat: int = 1):
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_index(tokens: int, walk_tokens: int, seq: int) -> list[str]:
    lengths = document_lengths(tokens)
    indices = np.arange(len(lengths), dtype=np.int32)
    doc_index = np.random.RandomState(1).permutation(indices).astype(np.int32)
    build_s, sample_index = timed(
        lambda: build_sample_index(lengths, doc_index, seq, 1, tokens), repeat=3
    )
    all_s, _ = timed(build_all_indices, lengths, indices, seq, None, 1234)

    small = document_lengths(walk_tokens, seed=2)
    small_doc = np.random.RandomState(1).permutation(len(small)).astype(np.int32)
    walk_s, walk = timed(reference_sample_index, small, small_doc, seq, 1, walk_tokens)
    ours_small = build_sample_index(small, small_doc, seq, 1, walk_tokens)
    assert np.array_equal(walk, ours_small)
    walk_scaled = walk_s * tokens / walk_tokens
    return [
        f"| sample index, {tokens / 1e6:.0f}M tokens, {len(lengths):,} docs, seq {seq} "
        f"({len(sample_index) - 1:,} samples) | {build_s * 1e3:.1f} ms | {walk_scaled:.2f} s "
        f"(walk {walk_s:.2f} s on {walk_tokens / 1e6:.0f}M, x{tokens // walk_tokens}) | "
        f"{walk_scaled / build_s:.0f}x |",
        f"| all three indices (document, sample, shuffle), same data | {all_s * 1e3:.1f} ms | | |",
    ]


def bench_blend(samples: int) -> list[str]:
    rows = []
    for weights in ([0.3, 0.7], [0.2, 0.3, 0.5]):
        ours_s, (ours, _) = timed(build_blending_indices, weights, samples)
        loop_out = np.zeros(samples, dtype=np.int64)
        loop_s, _ = timed(_greedy_python, weights, samples, 0, [0] * len(weights), loop_out)
        assert np.array_equal(loop_out, ours)
        rows.append(
            f"| blend indices, {len(weights)} datasets, {samples:,} samples | {ours_s:.2f} s | "
            f"{loop_s:.2f} s (plain loop) | {loop_s / ours_s:.1f}x |"
        )
    return rows


def bench_reads(tokens: int, seq: int, reads: int, workdir: str) -> list[str]:
    lengths = document_lengths(tokens, seed=3)
    prefix = os.path.join(workdir, "bench_text_document")
    rng = np.random.RandomState(4)
    start = time.perf_counter()
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        # Write in chunks of documents so that building the file stays quick.
        for chunk_start in range(0, len(lengths), 4096):
            chunk = lengths[chunk_start : chunk_start + 4096]
            builder.add_document(rng.randint(0, 50000, size=int(chunk.sum())), chunk.tolist())
        builder.finalize(prefix + ".idx")
    write_s = time.perf_counter() - start
    low = IndexedDataset(prefix)
    options = GPTDatasetOptions(seq_length=seq, eod=0)
    dataset = GPTDataset(low, prefix, np.arange(len(low), dtype=np.int32), reads, "train", options)
    order = np.random.RandomState(5).permutation(len(dataset))[:reads]
    ours_s, _ = timed(lambda: [dataset[int(k)] for k in order])
    raw = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    offsets = np.random.RandomState(6).randint(0, len(raw) - seq - 1, size=reads)
    raw_s, _ = timed(lambda: [np.asarray(raw[o : o + seq + 1], dtype=np.int64) for o in offsets])
    size_mb = os.path.getsize(prefix + ".bin") / 1e6
    return [
        f"| random reads, {reads:,} samples of seq {seq} from {tokens / 1e6:.0f}M tokens "
        f"({size_mb:.0f} MB .bin, written in {write_s:.1f} s) | {reads / ours_s:,.0f} samples/s "
        f"| {reads / raw_s:,.0f} samples/s (raw memmap slices) | {raw_s / ours_s:.2f}x |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--walk-tokens", type=int, default=5_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--blend-samples", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=10_000)
    args = parser.parse_args()
    print("| what | gigatron | reference | ratio (ref / gigatron time) |")
    print("|---|---|---|---|")
    for seq in (args.seq_length, 128):
        for row in bench_index(args.tokens, args.walk_tokens, seq):
            print(row, flush=True)
    for row in bench_blend(args.blend_samples):
        print(row, flush=True)
    workdir = tempfile.mkdtemp(prefix="gigatron-bench-dataset-")
    try:
        for row in bench_reads(args.tokens, args.seq_length, args.reads, workdir):
            print(row, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
