"""Benchmark `gigatron preprocess` against its ceiling: the tokenizer library alone.

Builds (or reuses) a JSON-lines English corpus of at least --size-mb MB under /tmp from the
shared WikiText-2 and LAMBADA files, then runs side by side on the same cores:
  ceiling    HF `tokenizers` encode_batch over the same texts, already parsed and in memory,
             with --workers library threads (the fastest the tokenizer alone can go);
  gigatron   `gigatron preprocess --workers N` from the file to .bin/.idx on disk.
Prints a markdown table: wall and CPU seconds, MB/s, tokens/s, peak resident memory of the
largest process, and the ratios to the ceiling (CPU seconds are the steadier figure on a
shared machine: ceiling CPU / gigatron CPU is the share of work that is tokenization).

    python benchmarks/bench_preprocess.py [--size-mb 50] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(
    os.environ.get(
        "GIGATRON_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"
    )
)

CEILING_SCRIPT = r"""
import json, os, resource, sys, time
corpus, vocab, merges = sys.argv[1:4]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
tokenizer = Tokenizer(models.BPE.from_file(vocab, merges))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
with open(corpus, encoding="utf-8") as stream:
    texts = [json.loads(line)["text"] for line in stream]
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu_start = usage.ru_utime + usage.ru_stime
start = time.perf_counter()
tokens = 0
for i in range(0, len(texts), 2048):
    for encoding in tokenizer.encode_batch(texts[i : i + 2048], add_special_tokens=False):
        tokens += len(encoding.ids)
elapsed = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu = usage.ru_utime + usage.ru_stime - cpu_start
print(json.dumps({"seconds": elapsed, "cpu": cpu, "tokens": tokens, "peak_kb": usage.ru_maxrss}))
"""

# Runs a command and reports the largest resident set among it and its descendants.
PEAK_WRAPPER = r"""
import json, resource, subprocess, sys, time
start = time.perf_counter()
result = subprocess.run(sys.argv[1:], capture_output=True, text=True)
elapsed = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": elapsed, "cpu": usage.ru_utime + usage.ru_stime,
                  "rc": result.returncode, "stdout": result.stdout,
                  "stderr": result.stderr[-2000:], "peak_kb": usage.ru_maxrss}))
"""


def build_corpus(path: Path, size_mb: float, seed: int = 1234) -> None:
    """Shuffled WikiText-2 paragraphs and LAMBADA passages, repeated to `size_mb` MB."""
    paragraphs = [
        line.strip()
        for line in (SHARED / "wikitext-2-wiki.test.tokens")
        .read_text(encoding="utf-8")
        .splitlines()
        if line.strip() and not line.strip().startswith("=")
    ]
    lambada = [
        json.loads(line)["text"]
        for line in (SHARED / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    documents = paragraphs + lambada
    rng = random.Random(seed)
    target = int(size_mb * 1e6)
    written = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as stream:
        while written < target:
            rng.shuffle(documents)
            for text in documents:
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                stream.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break
    tmp.rename(path)


def run_json(command: list[str], env: dict[str, str]) -> dict:
    output = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--corpus", default=None, help="reuse this JSON-lines file")
    args = parser.parse_args()

    corpus = Path(args.corpus or f"/tmp/gigatron_bench_corpus_{int(args.size_mb)}mb.jsonl")
    if not corpus.exists():
        print(f"building {corpus} ...", file=sys.stderr)
        build_corpus(corpus, args.size_mb)
    corpus_bytes = corpus.stat().st_size
    vocab = str(SHARED / "gpt2-vocab.json")
    merges = str(SHARED / "gpt2-merges.txt")

    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as out_dir:
        # gigatron first: RUSAGE_CHILDREN keeps the maximum over every child ever waited for.
        gigatron = run_json(
            [
                sys.executable,
                "-c",
                PEAK_WRAPPER,
                sys.executable,
                "-m",
                "gigatron.cli",
                "preprocess",
                "--input",
                str(corpus),
                "--output-prefix",
                os.path.join(out_dir, "bench"),
                "--workers",
                str(args.workers),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab,
                "--merge-file",
                merges,
            ],
            env,
        )
        if gigatron["rc"] != 0:
            print(gigatron["stderr"], file=sys.stderr)
            return 1
        tokens_line = next(x for x in gigatron["stdout"].splitlines() if "tokens" in x)
        gigatron_tokens = int(tokens_line.split(",")[1].split()[0])

    ceiling_env = dict(env, TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(args.workers))
    ceiling = run_json(
        [sys.executable, "-c", CEILING_SCRIPT, str(corpus), vocab, merges], ceiling_env
    )
    assert ceiling["tokens"] == gigatron_tokens, (ceiling["tokens"], gigatron_tokens)

    def row(name: str, run: dict, tokens: int, what: str) -> str:
        seconds = run["seconds"]
        mb_s = corpus_bytes / seconds / 1e6
        return (
            f"| {name} | {what} | {seconds:.2f} | {run['cpu']:.2f} | {mb_s:.2f} | "
            f"{tokens / seconds:,.0f} | {run['peak_kb'] / 1024:.0f} | "
            f"{ceiling['seconds'] / seconds:.2f} | {ceiling['cpu'] / run['cpu']:.2f} |"
        )

    print(
        f"corpus: {corpus} ({corpus_bytes / 1e6:.1f} MB, {gigatron_tokens:,} GPT-2 tokens), "
        f"{args.workers} workers/threads, {time.strftime('%Y-%m-%d')}"
    )
    print()
    print(
        "| run | measures | wall s | CPU s | MB/s | tokens/s | peak RSS (MiB) "
        "| wall ratio to ceiling | CPU ratio to ceiling |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        row(
            "ceiling: HF tokenizers encode_batch",
            ceiling,
            ceiling["tokens"],
            "tokenize only, texts in memory",
        )
    )
    print(
        row(
            f"gigatron preprocess --workers {args.workers}",
            gigatron,
            gigatron_tokens,
            "read + parse + tokenize + write, incl. start-up",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
