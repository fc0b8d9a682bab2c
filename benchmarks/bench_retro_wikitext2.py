"""Retro against the same-size GPT on WikiText-2 (CPU): validation perplexity.

    python benchmarks/bench_retro_wikitext2.py [--work DIR] [--train-iters 300] [--seed 1234]

The pipeline of docs/retro.md end to end, all through the `gigatron` commands:
1. the corpus: WikiText-2's test file (tests/data; the train file is not in the repository), one
   document per article (64 articles), GPT-2 tokens, split 90/10 in article order: the
   validation text is the last articles, none of which the models train on;
2. a random 2-layer BERT (`pretrain bert`, one step at learning rate 0) embeds the chunks: a
   random projection of each chunk's tokens, enough to find chunks sharing words;
3. `retro-preprocess` (chunk database, an exact Flat index, the neighbours of every train and
   validation chunk, excluding the sample's own articles);
4. `pretrain gpt` and `pretrain retro` with the same shape, data, seed and schedule; the
   validation loss at the end of each gives the perplexity (BENCHMARKS.md records both).
   `--families gpt` and `--families retro` in two processes on one `--work` train them side by
   side once the project is built.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gigatron.data.indexed import write_dataset
from gigatron.data.tokenizers import GPT2BPETokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(DATA / "gpt2-vocab.json"),
        "--merge-file", str(DATA / "gpt2-merges.txt")]  # fmt: skip
SEQ, CHUNK = 128, 32


def gigatron(*args: str) -> str:
    """Run `gigatron <args>`; its standard output (a failure raises with the output)."""
    command = [sys.executable, "-m", "gigatron.cli", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def articles(lines: list[str]) -> list[str]:
    """WikiText-2's articles (a ` = Title = ` line starts one), each its paragraphs joined by
    newlines; headings of sections (` = = ... = = `) are dropped."""
    found: list[list[str]] = []
    for line in lines:
        if line.startswith(" = ") and not line.startswith(" = = "):
            found.append([])
        elif line.strip() and not line.startswith(" =") and found:
            found[-1].append(line.strip())
    return ["\n".join(paragraphs) for paragraphs in found if paragraphs]


def write_corpus(work: Path) -> str:
    """WikiText-2 test articles as documents ending with eod, in the file's order."""
    tokenizer = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
    lines = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    docs = [[tokenizer.tokenize(text) + [tokenizer.eod]] for text in articles(lines)]
    prefix = str(work / "wikitext2_text_document")
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def common_flags(prefix: str, work: Path, train_iters: int, seed: int) -> list[str]:
    """Data and schedule shared by preprocessing and both models (the sample counts agree)."""
    return [
        "--data-path", prefix, "--split", "90,10,0", "--seq-length", str(SEQ), *GPT2,
        "--data-cache-path", str(work / "cache"), "--micro-batch-size", "8",
        "--global-batch-size", "8", "--train-iters", str(train_iters), "--eval-iters", "20",
        "--eval-interval", str(train_iters), "--seed", str(seed),
    ]  # fmt: skip


def make_bert(work: Path) -> Path:
    save = work / "bert"
    if (save / "latest_checkpointed_iteration.txt").is_file():  # a --work run before made it
        return save
    gigatron("pretrain", "bert", "--mock-data", "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", DATA / "bert-base-uncased-vocab.txt", "--num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "128", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "1", "--lr", "0", "--eval-iters", "0",
             "--save", save)  # fmt: skip
    return save


def validation_loss(metrics: Path) -> float | None:
    """The last validation loss of a run's metrics file (None before the run evaluated)."""
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [r for r in rows if r["type"] == "eval" and r.get("split") == "valid"]
    return float(valid[-1]["lm_loss"]) if valid else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--families",
        default="gpt,retro",
        help="the models to train (two --work runs of one family each train them side by side)",
    )
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="retro-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    prefix = write_corpus(work)
    common = common_flags(prefix, work, args.train_iters, args.seed)
    project = work / "project"
    started = time.perf_counter()
    gigatron("retro-preprocess", "--retro-project-dir", project, "--retro-bert-load",
             make_bert(work), "--retro-gpt-chunk-length", CHUNK, "--retro-index-str", "Flat",
             "--retro-bert-max-chunk-length", "96", "--retro-query-num-neighbors-query", "50",
             "--retro-query-num-neighbors-save", "2", "--retro-index-ntrain", "2000", *common)  # fmt: skip
    preprocess_s = time.perf_counter() - started
    model = ["--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4",
             "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
             "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--clip-grad", "1.0",
             "--log-interval", "50", "--num-workers", "0"]  # fmt: skip
    results = {}
    for family, extra in (
        ("gpt", []),
        ("retro", ["--retro-project-dir", str(project), "--retro-gpt-chunk-length", str(CHUNK)]),
    ):
        if family not in args.families.split(","):
            continue
        metrics = work / f"{family}.jsonl"
        started = time.perf_counter()
        if validation_loss(metrics) is None:  # (a --work run before may have trained it)
            metrics.unlink(missing_ok=True)
            gigatron("pretrain", family, *common, *model, *extra, "--metrics-file", metrics)
        loss = validation_loss(metrics)
        results[family] = (loss, math.exp(loss), time.perf_counter() - started)
    print(f"preprocessing: {preprocess_s:.0f} s")
    for family, (loss, ppl, seconds) in results.items():
        print(f"{family}: validation loss {loss:.4f}, perplexity {ppl:.1f} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
