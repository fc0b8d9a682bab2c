"""`gigatron evaluate`: zero-shot evaluation of a GPT checkpoint (Megatron's tasks/main.py with
--task WIKITEXT103 or LAMBADA), at the checkpoint's tp/pp layout with the data split over
data-parallel copies (torchrun), results printed and written as JSON."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gigatron.config.checkpoint_args import add_checkpoint_arguments
from gigatron.config.parser import command_parser
from gigatron.config.tasks import ZeroShotTaskConfig, add_task_arguments, task_config_from_namespace
from gigatron.errors import GigatronError
from gigatron.inference.arguments import add_retrieval_arguments
from gigatron.tasks import retro_qa


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "evaluate",
        "zero-shot WikiText perplexity or LAMBADA accuracy of a GPT checkpoint",
    )
    add_task_arguments(parser, ZeroShotTaskConfig)
    group = parser.add_argument_group("checkpoint and run")
    group.add_argument("--load", required=True, help="checkpoint directory (written by --save)")
    group.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: latest)")
    group.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    group.add_argument("--tokenizer-model", default=None, help="tokenizer file, if it moved")
    group.add_argument("--vocab-file", default=None, help="vocabulary file, if it moved")
    group.add_argument("--merge-file", default=None, help="BPE merges file, if it moved")
    group.add_argument(
        "--micro-batch-size", type=int, default=8, help="sequences per forward pass (default: 8)"
    )
    group.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per window (default: the checkpoint's --seq-length)",
    )
    group.add_argument(
        "--results-file", default=None, help="write the results here as JSON (default: none)"
    )
    group.add_argument("--no-progress-bar", action="store_true", help="no progress line")
    # --seq-length is the window above (Megatron's tasks use the model's length the same way).
    add_checkpoint_arguments(parser, skip=("seq_length",))
    retro_qa.add_qa_arguments(parser)
    add_retrieval_arguments(parser)
    return parser


class Progress:
    """Rank 0's progress on stderr: one line rewritten in place on a terminal; elsewhere (a log
    file, a zero-width console) a full line with the time left every `log_interval` batches
    (Megatron's --log-interval) or, without it, every LINE_EVERY_S seconds, and at the end."""

    LINE_EVERY_S = 10.0

    def __init__(
        self, label: str, enabled: bool, log_interval: int | None = None, stream: Any = None
    ) -> None:
        # why: training.metrics imports torch; here it loads after parsing, so --help stays fast
        from gigatron.training.metrics import format_eta, is_terminal, terminal_width

        self.format_eta = format_eta
        self.label, self.enabled, self.start = label, enabled, time.perf_counter()
        self.log_interval = log_interval
        self.stream = stream or sys.stderr
        self.in_place = is_terminal(self.stream) and terminal_width(self.stream) != 0
        self.last_line = self.start

    def _line_due(self, done: int, total: int, now: float) -> bool:
        if done == total:
            return True
        if self.log_interval:
            return done % max(1, self.log_interval) == 0
        return now - self.last_line >= self.LINE_EVERY_S

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = done / max(now - self.start, 1e-9)
        text = f"{self.label}: {done}/{total} batches ({rate:.1f}/s)"
        if self.in_place:
            end = "\n" if done == total else ""
            print(f"\r{text}", end=end, file=self.stream, flush=True)
        elif self._line_due(done, total, now):
            self.last_line = now
            eta = self.format_eta((total - done) / max(rate, 1e-9))
            print(f"{text} | ETA: {eta}", file=self.stream, flush=True)


def run_task(loaded: Any, task: ZeroShotTaskConfig, args: argparse.Namespace) -> dict[str, Any]:
    from gigatron.config.validate import params_dtype
    from gigatron.tasks import lambada, wikitext
    from gigatron.tasks.scoring import score_samples

    (path,) = task.valid_data
    seq_length = args.seq_length or loaded.cfg.model.seq_length
    tokenizer = loaded.tokenizer
    if task.task == "WIKITEXT103":
        data = wikitext.read_wikitext(path, tokenizer)
        samples = wikitext.window_samples(data.tokens, seq_length, task.overlapping_eval)
    else:
        samples = lambada.read_lambada(path, tokenizer, seq_length, task.strict_lambada)
    show = loaded.pctx.rank == 0 and not args.no_progress_bar
    start = time.perf_counter()
    scores = score_samples(
        loaded.chunks,
        loaded.pctx,
        samples,
        args.micro_batch_size,
        seq_length=seq_length,
        pipeline_dtype=params_dtype(loaded.cfg),
        on_batch=Progress(task.task, show, getattr(args, "log_interval", None)),
    )
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {"task": task.task, "valid_data": path, "load": args.load}
    result["iteration"] = loaded.iteration
    if task.task == "WIKITEXT103":
        total = float(scores[:, 0].sum())
        result.update(
            wikitext.perplexities(total, data.num_tokenized_tokens, data.num_original_tokens)
        )
        result["overlapping_eval"] = task.overlapping_eval
        result["scored_tokens"] = int(scores[:, 1].sum())
    else:
        correct = int(scores[:, 2].sum())
        result.update(
            {
                "strict_lambada": task.strict_lambada,
                "num_correct": correct,
                "num_examples": len(samples),
                "accuracy": correct / len(samples),
                # the perplexity of the target tokens: tells models apart when none is right
                "target_ppl": math.exp(float(scores[:, 0].sum()) / float(scores[:, 1].sum())),
            }
        )
    result.update(
        {
            "seq_length": seq_length,
            "windows": len(samples),
            "tokens_per_s": float(scores[:, 1].sum()) / max(elapsed, 1e-9),
            "time_s": elapsed,
            "world_size": loaded.pctx.world_size,
            "tp": loaded.pctx.tp_size,
            "pp": loaded.pctx.pp_size,
            "dp": loaded.pctx.dp_size,
        }
    )
    return result


def format_result(result: dict[str, Any]) -> str:
    if result["task"] == "WIKITEXT103":
        return (
            f"validation results on WIKITEXT103 | avg loss: {result['avg_loss']:.4E} | "
            f"ppl: {result['ppl']:.4E} | adjusted ppl: {result['adjusted_ppl']:.4E} | "
            f"token ratio: {result['token_ratio']:.6f} | original tokens: "
            f"{result['num_original_tokens']} | tokenized tokens: {result['num_tokenized_tokens']}"
        )
    return (
        f"validation results on LAMBADA{' (strict)' if result['strict_lambada'] else ''} | "
        f"number correct: {result['num_correct']} | total examples: {result['num_examples']} | "
        f"avg accuracy: {result['accuracy']:.4E} | target ppl: {result['target_ppl']:.4E}"
    )


def write_json(path: str | Path, value: Any) -> None:
    """Written aside and renamed, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(partial, path)


def evaluate(argv: Sequence[str]) -> dict[str, Any]:
    """Parse, load, evaluate; returns the results (every rank)."""
    args = build_parser().parse_args(list(argv))
    # why here: torch-heavy modules load after the flags are parsed (a quick --help)
    import torch.distributed as dist

    from gigatron.inference.load import load_for_inference
    from gigatron.training.run import apply_thread_choice

    task = task_config_from_namespace(ZeroShotTaskConfig, args)
    if task.task is None:
        raise GigatronError("--task: missing; give --task WIKITEXT103, LAMBADA or RETRO-QA")
    if len(task.valid_data) != 1:
        raise GigatronError("--valid-data: missing; give the file to evaluate on")
    if not Path(task.valid_data[0]).is_file():
        raise GigatronError(f"--valid-data {task.valid_data[0]}: no such file")
    if args.micro_batch_size < 1:
        raise GigatronError(f"--micro-batch-size {args.micro_batch_size}: must be at least 1")
    if task.overlapping_eval < 1:
        raise GigatronError(f"--overlapping-eval {task.overlapping_eval}: must be at least 1")
    retro_qa.check_task_flags(args, task)
    apply_thread_choice()  # one process: a few threads (docs/training.md)
    if task.task == retro_qa.TASK:
        return retro_qa.evaluate_qa(args, task, write_json)
    loaded = load_for_inference(args, data_parallel=True)
    try:
        result = run_task(loaded, task, args)
        if loaded.pctx.rank == 0:
            print(format_result(result), flush=True)
            if args.results_file:
                write_json(args.results_file, result)
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str]) -> int:
    evaluate(argv)
    return 0
