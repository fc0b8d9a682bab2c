"""`gigatron plot metrics.jsonl [--output loss.png]`: the loss curves of any run (training loss
per logged iteration, validation loss per evaluation) as a PNG, drawn by training/plot.py (the
quickstart's plot)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "plot",
        "Plot the training and validation loss of a run from its metrics.jsonl "
        "(--metrics-file; by default metrics.jsonl in --save).",
    )
    parser.add_argument("metrics", help="the run's metrics.jsonl")
    parser.add_argument(
        "--output", default=None, help="PNG to write (default: loss.png beside the metrics file)"
    )
    parser.add_argument("--title", default="gigatron loss", help="title of the plot")
    return parser


def check_metrics(path: str) -> int:
    """The number of plottable records (with an iteration and an lm_loss); a clear error when a
    file is not a metrics file or holds none."""
    from gigatron.training.plot import read_metrics

    try:
        records = read_metrics(path)
    except UnicodeDecodeError as error:
        raise GigatronError(
            f"{path}: not UTF-8 text ({error.reason}); give the metrics.jsonl a run wrote"
        ) from None
    if any(not isinstance(r, dict) for r in records):
        raise GigatronError(f"{path}: holds JSON that is not an object per line; not metrics")
    usable = [
        r
        for r in records
        if r.get("type") in ("train", "eval")
        and isinstance(r.get("iteration"), int)
        and isinstance(r.get("lm_loss"), (int, float))
    ]
    if not usable:
        raise GigatronError(
            f"{path}: no training or validation record with an 'lm_loss'; give the "
            "metrics.jsonl of a run that logged at least one iteration"
        )
    return len(usable)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    from gigatron.training.plot import plot_loss  # why: matplotlib loads after parsing

    if os.path.isdir(args.metrics):
        args.metrics = os.path.join(args.metrics, "metrics.jsonl")
    count = check_metrics(args.metrics)
    output = args.output or os.path.join(os.path.dirname(args.metrics) or ".", "loss.png")
    if os.path.isdir(output):
        raise GigatronError(f"--output {output}: a directory; give a .png file name")
    try:
        plot_loss(args.metrics, output, title=args.title)
    except OSError as error:
        raise GigatronError(f"--output {output}: cannot be written ({error.strerror})") from None
    print(f"wrote {output} ({count} records of {args.metrics})")
    return 0
