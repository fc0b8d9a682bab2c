"""`gigatron quickstart`: the whole workflow on one CPU in a few minutes.

1. corpus: the English help texts that ship with Python (`pydoc_data.topics`), one JSON line per
   topic;
2. tokenizer: a byte-level BPE trained on it (`gigatron train-tokenizer`);
3. data: tokenized into .bin/.idx (`gigatron preprocess`);
4. pretraining: a small GPT (`gigatron pretrain gpt`), validating as it goes, saving a checkpoint;
5. a sample: text generated from a prompt with the trained model (gigatron.inference);
6. a plot of training and validation loss (loss.png).

Every step is the real command's code; the flags it used are printed so that each step can be
rerun by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "quickstart",
        "Train a small GPT on a corpus shipped with Python, end to end, on CPU.",
    )
    parser.add_argument("--output-dir", default="quickstart-run", help="where everything goes")
    parser.add_argument("--iterations", type=int, default=800, help="training iterations")
    parser.add_argument("--hidden-size", type=int, default=128, help="transformer hidden size")
    parser.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    parser.add_argument(
        "--minutes", type=float, default=3.5, help="stop training after this many minutes"
    )
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--global-batch-size", type=int, default=16, help="samples per iteration")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=1234, help="random seed")
    parser.add_argument(
        "--prompt", default="The assert statement", help="text the sample continues"
    )
    parser.add_argument("--sample-tokens", type=int, default=48, help="tokens to generate")
    return parser


# ---- step 1: the corpus ---------------------------------------------------------------------
def write_corpus(path: str) -> int:
    """Python's own help topics as JSON lines ({"title", "text"}); returns the number written."""
    # why: the corpus (Python's help topics) loads only when writing it
    from pydoc_data.topics import topics

    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        for title in sorted(topics):
            handle.write(json.dumps({"title": title, "text": topics[title]}) + "\n")
    os.replace(temporary, path)
    return len(topics)


# Points on the quickstart's training curve (log lines and metrics records).
PLOT_POINTS = 200


def log_interval(iterations: int) -> int:
    """Iterations between log lines (and metrics.jsonl records): about PLOT_POINTS in all."""
    return max(1, iterations // PLOT_POINTS)


def plot_title(args: argparse.Namespace, parameters: int | None, done: int | None = None) -> str:
    """The run's shape, for the loss plot; `done` < --iterations: where --minutes stopped it."""
    size = f", {parameters / 1e6:.2f}M parameters" if parameters else ""
    iterations = f"{args.iterations} iterations"
    if done is not None and done < args.iterations:
        iterations = f"{done} of {args.iterations} iterations (--minutes {args.minutes:g})"
    return (
        f"gigatron quickstart: GPT {args.num_layers} layers x {args.hidden_size} hidden{size}\n"
        f"seq {args.seq_length}, global batch {args.global_batch_size}, vocab {args.vocab_size}, "
        f"lr {args.lr:g}, {iterations}"
    )


def _step(number: int, text: str) -> None:
    print(f"\n[{number}/6] {text}", flush=True)


def main(argv: Sequence[str]) -> int:
    """`gigatron quickstart [options]`."""
    # why: the training stack loads after parsing, so --help stays fast
    from gigatron.training.pretrain import parse_pretrain_config, pretrain
    from gigatron.training.run import apply_thread_choice

    args = build_parser().parse_args(list(argv))
    _check_arguments(args)
    apply_thread_choice()  # one process: a few threads (docs/training.md)
    started = time.perf_counter()
    out, checkpoints, metrics_path = _fresh_output_dir(args.output_dir)
    tokenizer_flags, data_prefix = _prepare_data(args, out)

    _step(4, f"pretrain: GPT {args.num_layers} layers x {args.hidden_size} hidden")
    flags = pretrain_flags(args, data_prefix, tokenizer_flags, checkpoints, metrics_path)
    print("gigatron pretrain gpt " + " ".join(flags), flush=True)
    cfg = parse_pretrain_config(flags, world_size=1)
    result, chunks = pretrain(cfg, keep_model=True, evaluate_on_early_exit=True)
    if result.exit_reason == "exit-duration":
        print(f"stopped after {args.minutes} minutes at iteration {result.iteration}")

    _step(5, "sample")
    _print_sample(args, cfg, chunks)

    _step(6, "plot")
    summary = _plot_and_summary(args, out, metrics_path, result, started)
    print(f"checkpoint: {checkpoints}   metrics: {metrics_path}")
    print(f"done in {summary['seconds']:.0f} s; all outputs are in {out}")
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    for value, flag in (
        (args.iterations, "--iterations"),
        (args.hidden_size, "--hidden-size"),
        (args.num_layers, "--num-layers"),
        (args.seq_length, "--seq-length"),
        (args.minutes, "--minutes"),
    ):
        if value <= 0:
            raise GigatronError(f"{flag} {value}: must be positive")
    if args.hidden_size % 4:
        raise GigatronError(f"--hidden-size {args.hidden_size}: use a multiple of 4 (4 heads)")


def _fresh_output_dir(output_dir: str) -> tuple[str, str, str]:
    """(output dir, checkpoints dir, metrics file); what an earlier quickstart left is removed."""
    out = os.path.abspath(output_dir)
    os.makedirs(out, exist_ok=True)
    checkpoints = os.path.join(out, "checkpoints")
    metrics_path = os.path.join(out, "metrics.jsonl")
    # A quickstart always starts fresh: drop what an earlier quickstart left in this directory.
    shutil.rmtree(checkpoints, ignore_errors=True)
    for stale in (metrics_path, os.path.join(out, "loss.png")):
        if os.path.exists(stale):
            os.remove(stale)
    return out, checkpoints, metrics_path


def _prepare_data(args: argparse.Namespace, out: str) -> tuple[list[str], str]:
    """Steps 1-3 (corpus, tokenizer, .bin/.idx); returns the tokenizer flags and data prefix."""
    from gigatron.data import preprocess, train_tokenizer  # why: keeps --help fast

    _step(1, "corpus: Python's help topics (pydoc_data.topics)")
    corpus = os.path.join(out, "corpus.jsonl")
    count = write_corpus(corpus)
    print(f"wrote {count} documents ({os.path.getsize(corpus) / 1e6:.2f} MB) to {corpus}")

    _step(2, f"tokenizer: byte-level BPE with {args.vocab_size} tokens")
    tokenizer_dir = os.path.join(out, "tokenizer")
    train_tokenizer.main(
        ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-size",
         str(args.vocab_size), "--output-dir", tokenizer_dir]
    )  # fmt: skip
    tokenizer_flags = [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", os.path.join(tokenizer_dir, "vocab.json"),
        "--merge-file", os.path.join(tokenizer_dir, "merges.txt"),
    ]  # fmt: skip

    _step(3, "data: tokenize into .bin/.idx")
    prefix = os.path.join(out, "data", "pydoc")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    preprocess.main(
        ["--input", corpus, "--output-prefix", prefix, "--append-eod", "--workers", "1",
         *tokenizer_flags]
    )  # fmt: skip
    return tokenizer_flags, f"{prefix}_text_document"


def pretrain_flags(
    args: argparse.Namespace,
    data_prefix: str,
    tokenizer_flags: list[str],
    checkpoints: str,
    metrics_path: str,
) -> list[str]:
    """The `gigatron pretrain gpt` flags of step 4 (printed, so the step can be rerun)."""
    # Eight validations, the last one at the final iteration.
    eval_interval = max(1, args.iterations // 8)
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length),
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.iterations),
        "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, args.iterations // 20)),
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--data-path", data_prefix, "--split", "90,10,0", "--num-workers", "0",
        *tokenizer_flags,
        "--eval-interval", str(eval_interval), "--eval-iters", "4", "--eval-at-start",
        "--log-interval", str(log_interval(args.iterations)),
        "--save", checkpoints, "--metrics-file", metrics_path,
        "--exit-duration-in-mins", str(args.minutes), "--seed", str(args.seed),
        "--device", "cpu",
    ]  # fmt: skip


def _print_sample(args: argparse.Namespace, cfg: Any, chunks: list[Any]) -> None:
    """Step 5: the prompt continued by the trained model."""
    # why: inference and the tokenizers load only when this step runs
    from gigatron.data.tokenizers import build_tokenizer
    from gigatron.inference import SamplingParams
    from gigatron.inference.load import build_engine
    from gigatron.parallel.context import ParallelContext

    tokenizer = build_tokenizer(cfg.tokenizer)
    engine = build_engine(chunks, ParallelContext.single(), tokenizer, max_batch_size=1)
    prompt_ids = tokenizer.tokenize(args.prompt)[-(args.seq_length - 1) :]
    params = SamplingParams(
        max_tokens=max(0, min(args.sample_tokens, args.seq_length - len(prompt_ids))),
        top_k=5, temperature=0.8, seed=args.seed,
    )  # fmt: skip
    (sample,) = engine.generate([prompt_ids], params)
    print(f"prompt: {args.prompt!r}")
    print("sample (top-5 sampling, temperature 0.8):")
    print(args.prompt + sample.text)


def _plot_and_summary(
    args: argparse.Namespace, out: str, metrics_path: str, result: Any, started: float
) -> dict[str, Any]:
    """Step 6: loss.png and summary.json; returns the summary."""
    from gigatron.training.plot import plot_loss, read_metrics  # why: matplotlib is heavy

    startup = [r for r in read_metrics(metrics_path) if r.get("type") == "startup"]
    parameters = startup[-1].get("parameters") if startup else None
    title = plot_title(args, parameters, result.iteration)
    png = plot_loss(metrics_path, os.path.join(out, "loss.png"), title=title)
    valid = sorted(result.valid_losses.items())
    summary = {
        "plot_title": title,
        "iterations": result.iteration,
        "valid_loss_start": valid[0][1] if valid else None,
        "valid_loss_end": valid[-1][1] if valid else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    print(f"loss plot: {png}")
    if valid:
        print(
            f"validation loss: {valid[0][1]:.3f} at iteration {valid[0][0]} -> "
            f"{valid[-1][1]:.3f} at iteration {valid[-1][0]}"
        )
    return summary
