"""metrics.jsonl records, log lines, progress bar, memory accounting and the loss plot."""

from __future__ import annotations

import io
import json
import math

import torch
from torch import nn

from gigatron.parallel.context import ParallelContext
from gigatron.training.metrics import (
    MetricsLogger,
    count_parameters,
    default_metrics_path,
    format_log_line,
    memory_footprint,
)
from gigatron.training.plot import plot_loss, read_metrics


def _train_record(iteration: int, loss: float) -> dict:
    return {
        "iteration": iteration, "consumed_samples": 4 * iteration, "lm_loss": loss,
        "lr": 1e-3, "grad_norm": 0.5, "loss_scale": 1.0, "iteration_time_s": 0.25,
        "tokens_per_s": 512.0, "mfu": None, "skipped_iterations": 0, "global_batch_size": 4,
    }  # fmt: skip


def test_records_and_plain_log_lines(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    out = io.StringIO()
    logger = MetricsLogger(str(path), ParallelContext.single(), train_iters=10, stream=out)
    logger.log_startup({"parameters": 1234, "bytes_per_rank": []})
    logger.log_iteration(_train_record(5, 2.5), train_iters=10)
    logger.log_iteration(_train_record(10, float("nan")), train_iters=10)
    logger.log_evaluation({"iteration": 10, "split": "valid", "lm_loss": 2.0, "ppl": math.exp(2)})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records] == ["startup", "train", "train", "eval"]
    assert records[0]["parameters"] == 1234
    assert records[1]["lm_loss"] == 2.5 and records[1]["tokens_per_s"] == 512.0
    assert records[2]["lm_loss"] is None  # NaN is not JSON: written as null
    assert records[3]["split"] == "valid" and records[3]["ppl"] == math.exp(2)
    text = out.getvalue()
    assert "iteration        5/      10" in text
    assert "lm loss: 2.500000E+00" in text and "MFU: n/a" in text
    assert "valid loss at iteration 10" in text
    assert "lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00" in text
    # A second logger appends (a resumed run continues the file).
    logger = MetricsLogger(str(path), ParallelContext.single(), stream=io.StringIO())
    logger.log_iteration(_train_record(11, 1.5))
    logger.close()
    assert len(read_metrics(str(path))) == 5


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal(tmp_path):
    out = _Terminal()
    logger = MetricsLogger(str(tmp_path / "m.jsonl"), ParallelContext.single(), 10, stream=out)
    logger.log_iteration(_train_record(5, 2.5), train_iters=10)
    logger.close()
    text = out.getvalue()
    assert "5/10" in text and "loss 2.5000" in text
    assert "consumed samples" not in text  # no plain log line under a bar


def test_log_line_format():
    line = format_log_line({**_train_record(3, 1.0), "mfu": 0.4123}, 7)
    assert line.startswith(" iteration        3/       7 |")
    assert "MFU: 41.2%" in line and "elapsed time per iteration (ms): 250.0" in line


def test_log_throughput_and_timers_lines(tmp_path):
    """--log-throughput adds Megatron's TFLOP/s per GPU; --timing-log-level 1 a timers line."""
    record = {**_train_record(3, 1.0), "tflops_per_s": 6.0, "time_optimizer_ms": 12.5}
    plain = format_log_line(record, 7)
    assert "TFLOP/s" not in plain
    line = format_log_line(record, 7, log_throughput=True, world_size=4)
    assert "| throughput per GPU (TFLOP/s/GPU): 1.5 |" in line
    out = io.StringIO()
    logger = MetricsLogger(
        str(tmp_path / "m.jsonl"), ParallelContext.single(), stream=out, log_throughput=True,
        timing_log_level=1,
    )  # fmt: skip
    logger.log_iteration(record, train_iters=7)
    logger.close()
    lines = out.getvalue().splitlines()
    assert "throughput per GPU (TFLOP/s/GPU): 6.0" in lines[0]
    assert lines[1] == " time in the last log interval (ms): optimizer: 12.5 |"


def test_default_metrics_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_metrics_path("x.jsonl", "/ckpt") == "x.jsonl"
    assert default_metrics_path(None, "/ckpt") == "/ckpt/metrics.jsonl"
    assert default_metrics_path(None, None) == str(tmp_path / "metrics.jsonl")


def test_memory_footprint_counts_storages_once():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    buffer = torch.zeros(numel)  # one contiguous gradient buffer, as DDP keeps it
    offset = 0
    for p in params:
        p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        p.grad = p.main_grad
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    sizes = memory_footprint([model], optimizer)
    assert sizes["parameter_bytes"] == 4 * numel
    assert sizes["gradient_bytes"] == 4 * numel
    # exp_avg and exp_avg_sq per parameter, plus one fp32 scalar `step` per parameter tensor.
    assert sizes["optimizer_state_bytes"] == 2 * 4 * numel + 4 * len(params)
    assert count_parameters([model], ParallelContext.single()) == numel


def test_plot_title_and_points(tmp_path):
    """The plot carries the run's title and one training point per logged iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(str(path), ParallelContext.single(), stream=io.StringIO())
    for i in range(1, 6):
        logger.log_iteration(_train_record(i, 5.0 - i))
    logger.close()
    saved = {}
    close = plt.close

    def keep(figure=None):
        saved["figure"] = figure
        close(figure)

    plt.close = keep
    try:
        plot_loss(str(path), str(tmp_path / "loss.png"), title="GPT 2 layers x 64")
    finally:
        plt.close = close
    (axes,) = saved["figure"].axes
    assert axes.get_title() == "GPT 2 layers x 64"
    assert list(axes.lines[0].get_xdata()) == [1, 2, 3, 4, 5]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(str(path), ParallelContext.single(), stream=io.StringIO())
    for i in range(1, 6):
        logger.log_iteration(_train_record(i, 5.0 - i))
    logger.log_evaluation({"iteration": 5, "split": "valid", "lm_loss": 1.5, "ppl": 4.48})
    logger.close()
    png = plot_loss(str(path), str(tmp_path / "loss.png"))
    with open(png, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
