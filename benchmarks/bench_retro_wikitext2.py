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

from gigatron.config import GigatronConfig
from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.indexed import write_dataset
from gigatron.data.retro.store import RetroNeighbourStore
from gigatron.data.tokenizers import GPT2BPETokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(DATA / "gpt2-vocab.json"),
        "--merge-file", str(DATA / "gpt2-merges.txt")]  # fmt: skip
SEQ, CHUNK = 128, 32
BATCH, EVAL_ITERS = 8, 20
# The validation samples a run asks for: EVAL_ITERS batches at each of (train_iters //
# eval_interval + 1) = 2 evaluations (Megatron's count; --eval-interval is --train-iters).
VALID_SAMPLES = EVAL_ITERS * BATCH * 2


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


def write_corpus(work: Path, texts: list[str]) -> str:
    """The articles as documents ending with eod, in the file's order."""
    tokenizer = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
    docs = [[tokenizer.tokenize(text) + [tokenizer.eod]] for text in texts]
    prefix = str(work / "wikitext2_text_document")
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def common_flags(prefix: str, work: Path, train_iters: int, seed: int) -> list[str]:
    """Data and schedule shared by preprocessing and both models (the sample counts agree)."""
    return [
        "--data-path", prefix, "--split", "90,10,0", "--seq-length", str(SEQ), *GPT2,
        "--data-cache-path", str(work / "cache"), "--micro-batch-size", str(BATCH),
        "--global-batch-size", str(BATCH), "--train-iters", str(train_iters), "--eval-iters", str(EVAL_ITERS),
        "--eval-interval", str(train_iters), "--seed", str(seed),
    ]  # fmt: skip


BERT = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
        str(DATA / "bert-base-uncased-vocab.txt")]  # fmt: skip
BERT_SHAPE = ["--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "64",
              "--max-position-embeddings", "128", "--eval-iters", "0", "--num-workers", "0"]  # fmt: skip


def make_random_bert(work: Path) -> Path:
    """A random 2-layer BERT (one step at learning rate 0)."""
    save = work / "bert"
    if (save / "latest_checkpointed_iteration.txt").is_file():  # a --work run before made it
        return save
    gigatron("pretrain", "bert", "--mock-data", *BERT, *BERT_SHAPE, "--hidden-size", "64",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
             "--lr", "0", "--save", save)  # fmt: skip
    return save


def make_trained_bert(work: Path, texts: list[str]) -> Path:
    """A 2-layer BERT trained (masked LM + sentence order, 150 steps of 16) on the articles of
    the GPT train split only (the first 90%, rounded down), split into sentences."""
    save = work / "bert-trained"
    if (save / "latest_checkpointed_iteration.txt").is_file():
        return save
    corpus = work / "bert-train.jsonl"
    train = texts[: math.floor(0.9 * len(texts))]
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in train))
    prefix = work / "bert_wikitext2"
    gigatron("preprocess", "--input", corpus, "--output-prefix", prefix, "--split-sentences",
             *BERT, "--workers", "1")  # fmt: skip
    gigatron("pretrain", "bert", "--data-path", f"{prefix}_text_sentence", "--split", "100,0,0",
             *BERT, *BERT_SHAPE, "--hidden-size", "64", "--micro-batch-size", "16",
             "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--train-iters", "150",
             "--data-cache-path", work / "bert-cache", "--save", save)  # fmt: skip
    return save


def validation_loss(metrics: Path) -> float | None:
    """The last validation loss of a run's metrics file (None before the run evaluated)."""
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [r for r in rows if r["type"] == "eval" and r.get("split") == "valid"]
    return float(valid[-1]["lm_loss"]) if valid else None


def novel_tokens_retrieved(text: np.ndarray, neighbours: np.ndarray) -> tuple[int, int]:
    """(novel, found): the tokens a sample's chunk groups predict (chunk j + 1, from chunk j's
    neighbours) that occur nowhere before them in the sample, and how many of those occur in
    chunk j's neighbours."""
    novel = found = 0
    for j in range(len(neighbours) - 1):
        retrieved = set(neighbours[j].ravel().tolist())
        for q in range((j + 1) * CHUNK, (j + 2) * CHUNK):
            if text[q] not in text[:q]:
                novel += 1
                found += int(text[q] in retrieved)
    return novel, found


def retrieval_hit_rates(project: Path, prefix: str, work: Path, seed: int) -> tuple[float, float]:
    """Of the validation tokens that are new to their sample, the share found in the neighbours
    retrieved for them, and in the neighbours of another sample (what chance gives)."""
    store = RetroNeighbourStore.open(project, "valid", 2, 2, SEQ, CHUNK)
    cfg = GigatronConfig()
    cfg.model.seq_length, cfg.training.seed = SEQ, seed
    cfg.data.data_path, cfg.data.split = [prefix], "90,10,0"
    cfg.data.data_cache_path = str(work / "cache")
    tokenizer = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
    valid = build_gpt_datasets(cfg, tokenizer, (1, VALID_SAMPLES, None))[1]
    store.check_dataset(valid)
    totals = np.zeros((2, 2))
    for i in range(len(store)):
        sample = valid[i]
        text = np.concatenate([sample["tokens"], sample["labels"][-1:]])
        other = store.neighbour_tokens((i + len(store) // 2) % len(store))
        totals[0] += novel_tokens_retrieved(text, store.neighbour_tokens(i))
        totals[1] += novel_tokens_retrieved(text, other)
    return totals[0, 1] / totals[0, 0], totals[1, 1] / totals[1, 0]


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
    parser.add_argument(
        "--retriever",
        choices=("random", "trained"),
        default="random",
        help="the BERT that embeds the chunks: random, or trained on the train articles",
    )
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="retro-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    lines = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    texts = articles(lines)
    prefix = write_corpus(work, texts)
    common = common_flags(prefix, work, args.train_iters, args.seed)
    trained = args.retriever == "trained"
    project = work / ("project-trained" if trained else "project")
    started = time.perf_counter()
    bert = make_trained_bert(work, texts) if trained else make_random_bert(work)
    gigatron("retro-preprocess", "--retro-project-dir", project, "--retro-bert-load",
             bert, "--retro-gpt-chunk-length", CHUNK, "--retro-index-str", "Flat",
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
        metrics = work / f"{family}{'-trained' if trained and family == 'retro' else ''}.jsonl"
        started = time.perf_counter()
        if validation_loss(metrics) is None:  # (a --work run before may have trained it)
            metrics.unlink(missing_ok=True)
            gigatron("pretrain", family, *common, *model, *extra, "--metrics-file", metrics)
        loss = validation_loss(metrics)
        results[family] = (loss, math.exp(loss), time.perf_counter() - started)
    print(f"preprocessing: {preprocess_s:.0f} s")
    hits, chance = retrieval_hit_rates(project, prefix, work, args.seed)
    print(
        f"validation tokens new to their sample found in its neighbours: {hits:.1%} "
        f"(in another sample's neighbours: {chance:.1%})"
    )
    for family, (loss, ppl, seconds) in results.items():
        print(f"{family}: validation loss {loss:.4f}, perplexity {ppl:.1f} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
