"""`gigatron data dedup` on 100k documents: documents/s and peak memory, and its MinHash-LSH core
against datasketch's (MinHash.update_batch + MinHashLSH) on the same documents, side by side.

python benchmarks/bench_dedup.py [--docs 100000] [--compare-docs 20000] [--workers 2]
Needs `pip install datasketch` for the comparison row (not a gigatron dependency).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT / "tests" / "data" / "wikitext-2-wiki.test.tokens"


def corpus(count: int, seed: int = 0) -> tuple[list[str], int]:
    """`count` documents of real words (3 WikiText-2 paragraphs each, shuffled words), 5% of
    them near copies of an earlier one; the number planted."""
    rng = random.Random(seed)
    lines = [line.split() for line in WIKITEXT.read_text().splitlines() if len(line.split()) > 30]
    docs, planted = [], 0
    for index in range(count):
        if index > 10 and rng.random() < 0.05:
            words = docs[rng.randrange(index)].split()
            words[rng.randrange(len(words))] = "changed"
            planted += 1
        else:
            words = [w for line in rng.sample(lines, 3) for w in line]
            rng.shuffle(words)
        docs.append(" ".join(words))
    return docs, planted


# Runs the command and reports the peak memory of its main process and of its largest worker
# (measured inside it: a child's high-water mark would otherwise include this process's pages).
MEASURED = (
    "import resource, sys\n"
    "from gigatron.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "usage = [resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, "
    "resource.RUSAGE_CHILDREN)]\n"
    "print('peak_kib', *usage, file=sys.stderr)\n"
    "sys.exit(status)\n"
)


def run_cli(path: Path, workers: int) -> dict:
    output = path.with_suffix(".out.jsonl")
    command = [sys.executable, "-c", MEASURED, "data", "dedup", "--input", str(path),
               "--output", str(output), "--workers", str(workers)]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    lines = result.stderr.strip().splitlines()
    main_kib, worker_kib = (int(v) for v in lines[-1].split()[1:])
    return {"seconds": seconds, "peak_mib_main": main_kib / 1024,
            "peak_mib_worker": worker_kib / 1024, "log": lines[-2]}  # fmt: skip


def gigatron_core(docs: list[str]) -> tuple[float, int]:
    from gigatron.data.corpus import minhash

    start = time.perf_counter()
    signatures = np.stack([minhash.signature(doc, 128, 1234) for doc in docs])
    groups = minhash.UnionFind(len(docs))
    minhash.near_duplicate_groups(signatures, 16, 0.9, groups)
    removed = sum(groups.find(i) != i for i in range(len(docs)))
    return time.perf_counter() - start, removed


def datasketch_core(docs: list[str]) -> tuple[float, int]:
    from datasketch import MinHash, MinHashLSH

    from gigatron.data.corpus.minhash import SHINGLE_BYTES, normalise

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=0.9, num_perm=128)
    removed = 0
    for index, doc in enumerate(docs):
        data = normalise(doc)
        grams = {data[i : i + SHINGLE_BYTES] for i in range(len(data) - SHINGLE_BYTES + 1)}
        signature = MinHash(num_perm=128, seed=1)
        signature.update_batch(list(grams))
        if lsh.query(signature):
            removed += 1
        else:
            lsh.insert(str(index), signature)
    return time.perf_counter() - start, removed


def write_corpus(path: Path, count: int) -> int:
    docs, planted = corpus(count)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return planted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--compare-docs", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--write-corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_corpus:  # in a child: the command below then starts from a small process
        print(write_corpus(args.write_corpus, args.docs))
        return
    rows: dict = {"docs": args.docs}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "docs.jsonl"
        made = subprocess.run([sys.executable, __file__, "--write-corpus", str(path), "--docs",
                               str(args.docs)], capture_output=True, text=True, check=True)  # fmt: skip
        rows["planted"] = int(made.stdout)
        rows["cli"] = run_cli(path, args.workers)
    rows["cli"]["docs_per_s"] = args.docs / rows["cli"]["seconds"]
    subset = corpus(args.compare_docs)[0]
    ours, ours_removed = gigatron_core(subset)
    theirs, theirs_removed = datasketch_core(subset)
    rows["core"] = {
        "docs": len(subset),
        "gigatron_s": ours,
        "gigatron_removed": ours_removed,
        "datasketch_s": theirs,
        "datasketch_removed": theirs_removed,
        "speedup": theirs / ours,
    }
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
