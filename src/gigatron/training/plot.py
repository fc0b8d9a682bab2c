"""A PNG of training and validation loss read from metrics.jsonl (matplotlib, no display)."""

from __future__ import annotations

import json
import os
from typing import Any

from gigatron.errors import GigatronError


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    if not os.path.isfile(path):
        raise GigatronError(f"{path}: no such metrics file; run training first")
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise GigatronError(f"{path}:{number}: not a JSON line ({exc})") from None
    return records


def plot_loss(metrics_path: str, output_png: str, title: str = "gigatron loss") -> str:
    """Write training loss (per logged iteration) and validation loss against iterations."""
    # why: matplotlib is optional
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must be chosen before pyplot is imported
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["iteration"], r["lm_loss"]) for r in records if r.get("type") == "train"]
    valid = [
        (r["iteration"], r["lm_loss"])
        for r in records
        if r.get("type") == "eval" and r.get("split") == "valid"
    ]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        axes.plot(*zip(*[p for p in train if p[1] is not None]), label="training", lw=1.2)
    if valid:
        axes.plot(*zip(*valid), "o-", label="validation", lw=1.5)
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss (nats/token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    temporary = output_png + ".tmp.png"
    figure.savefig(temporary)
    plt.close(figure)
    os.replace(temporary, output_png)
    return output_png
