"""Where a run reports: metrics.jsonl (always), TensorBoard and Weights & Biases (when installed
and asked for), and the terminal (a progress bar on a TTY, plain log lines otherwise).

Only one process writes: the last global rank, which sits on the last pipeline stage where the
loss is known (Megatron logs from the same rank). Every record is one JSON object per line, with
a `type` of `startup`, `train` or `eval`, so the file can be read with
`[json.loads(line) for line in open("metrics.jsonl")]`.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.optim.clip_grads import counts_in_norm, is_expert, reduce_model_statistic
from gigatron.optim.memory import memory_bytes_per_rank
from gigatron.parallel.context import ParallelContext
from gigatron.training.notice import SlowStartNotice


def default_metrics_path(metrics_file: str | None, save_dir: str | None) -> str:
    """--metrics-file, else metrics.jsonl inside --save, else in the working directory."""
    if metrics_file:
        return metrics_file
    return os.path.join(save_dir or os.getcwd(), "metrics.jsonl")


def _json_value(value: Any) -> Any:
    """Plain JSON for tensors and numbers; NaN and inf become null (JSON has no such numbers)."""
    if torch.is_tensor(value):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """One run's reporting. Call the log_* methods on every rank; only the writer rank writes."""

    def __init__(
        self,
        path: str,
        pctx: ParallelContext,
        train_iters: int | None = None,
        start_iteration: int = 0,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        wandb_exp_name: str | None = None,
        progress_bar: bool | None = None,
        stream: Any = None,
        loss_names: tuple[str, ...] = ("lm_loss",),
        log_throughput: bool = False,
        timing_log_level: int = 0,
        tensorboard_timers: bool = False,
        tensorboard_validation_ppl: bool = False,
    ) -> None:
        self.path = path
        # The family's named losses (record keys); the first is the main one.
        self.loss_names = tuple(loss_names)
        self.pctx = pctx
        # --log-throughput: the log line also shows model TFLOP/s per GPU (Megatron's figure).
        self.log_throughput = log_throughput
        # --timing-log-level 1: a line of phase timers after each log line.
        self.timing_log_level = timing_log_level
        # --log-timers-to-tensorboard, --log-validation-ppl-to-tensorboard.
        self.tensorboard_timers = tensorboard_timers
        self.tensorboard_validation_ppl = tensorboard_validation_ppl
        self.is_writer = pctx.rank == pctx.world_size - 1
        self.stream = stream or sys.stdout
        self._file = None
        self._tensorboard = None
        self._wandb = None
        self._bar = None
        # Until the first log line, say now and then which iteration is running.
        self._notice = SlowStartNotice(self.message)
        if not self.is_writer:
            return
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        # Append: a resumed run continues the same file.
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard_dir:
            self._tensorboard = _open_tensorboard(tensorboard_dir, self.message)
        if wandb_project:
            self._wandb = _open_wandb(wandb_project, wandb_exp_name, self.message)
        if progress_bar is None:
            # A bar only on a terminal that has a width; log lines everywhere else.
            progress_bar = is_terminal(self.stream) and terminal_width(self.stream) != 0
        if progress_bar and train_iters:
            # why: tqdm loads only for a terminal's progress bar
            from tqdm import tqdm

            self._bar = tqdm(
                total=train_iters, initial=start_iteration, file=self.stream, unit="it",
                dynamic_ncols=True,
            )  # fmt: skip

    # ---- writing --------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Append one record to metrics.jsonl (writer rank only)."""
        if self._file is None:
            return
        clean = {key: _json_value(value) for key, value in record.items()}
        clean.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def message(self, text: str) -> None:
        """A line for the user, above the progress bar when there is one."""
        if not self.is_writer:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def log_startup(self, record: dict[str, Any]) -> None:
        self.write({"type": "startup", **record})
        if self.is_writer:
            params = record.get("parameters")
            per_rank = record.get("bytes_per_rank") or []
            if params is not None:
                active = record.get("active_parameters")
                extra = f" ({active:,} active per token)" if active is not None else ""
                self.message(f"> model parameters: {params:,}{extra}")
            trainable = record.get("trainable_parameters")
            if trainable is not None and params:
                share = 100.0 * trainable / params
                self.message(f"> trainable parameters: {trainable:,} ({share:.2f}%)")
            for entry in per_rank:
                self.message(
                    "> rank {rank}: parameters {p:.1f} MiB, gradients {g:.1f} MiB, "
                    "optimizer state {o:.1f} MiB".format(
                        rank=entry["rank"],
                        p=entry["parameter_bytes"] / 2**20,
                        g=entry["gradient_bytes"] / 2**20,
                        o=entry["optimizer_state_bytes"] / 2**20,
                    )
                )

    def iteration_started(self, iteration: int) -> None:
        """Called by the loop before each iteration (see training/notice.py)."""
        if self.is_writer:
            self._notice.iteration_started(iteration)

    def log_iteration(self, record: dict[str, Any], train_iters: int | None = None) -> None:
        """A training record: metrics.jsonl, TensorBoard, W&B, and a log line or the bar."""
        self._notice.stop()
        self.write({"type": "train", **record})
        if not self.is_writer:
            return
        iteration = record["iteration"]
        scalars = {
            **{_label(name): record.get(name) for name in self.loss_names},
            "learning-rate": record.get("lr"),
            "grad-norm": record.get("grad_norm"),
            "loss-scale": record.get("loss_scale"),
            "batch-size": record.get("global_batch_size"),
            "iteration-time": record.get("iteration_time_s"),
            "throughput/tokens_per_s": record.get("tokens_per_s"),
            "params-norm": record.get("params_norm"),
            # Present when --log-memory-to-tensorboard asked for them.
            **{
                f"mem/{key[len('memory_') :]}": value
                for key, value in record.items()
                if key.startswith("memory_")
            },
        }
        if self.tensorboard_timers:
            scalars.update(
                {
                    f"{key[len('time_') : -len('_ms')]}-time": value
                    for key, value in record.items()
                    if key.startswith("time_") and key.endswith("_ms")
                }
            )
        self._scalars(scalars, iteration)
        if self._bar is not None:
            self._bar.update(iteration - self._bar.n)
            self._bar.set_postfix_str(bar_postfix(record, self.loss_names[0]))
        else:
            self.message(
                format_log_line(
                    record,
                    train_iters,
                    self.loss_names,
                    log_throughput=self.log_throughput,
                    world_size=self.pctx.world_size,
                )
            )
        if self.timing_log_level >= 1:
            self.message(format_timers_line(record))

    def log_evaluation(self, record: dict[str, Any]) -> None:
        self.write({"type": "eval", **record})
        if not self.is_writer:
            return
        split = record["split"]
        scalars = {}
        pieces = []
        for name in self.loss_names:
            value = record.get(name)
            ppl = record.get(f"{name}_ppl")
            if ppl is None and value is not None:
                ppl = math.exp(min(value, 700.0))
            scalars[f"{split} {_label(name)}"] = value
            if self.tensorboard_validation_ppl:
                scalars[f"{split} {_label(name)} ppl"] = ppl
            if value is not None:
                pieces.append(
                    f"{_label(name)} value: {value:.6E} | {_label(name)} PPL: {ppl:.6E} |"
                )
        self._scalars(scalars, record.get("iteration", 0))
        line = f" {split} loss at iteration {record.get('iteration')} | " + " ".join(pieces)
        bar = "-" * (len(line) + 1)
        self.message(f"{bar}\n{line}\n{bar}")

    def _scalars(self, scalars: dict[str, Any], step: int) -> None:
        values = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float))}
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        self._notice.stop()
        ends = (
            ("_bar", "close"),
            ("_tensorboard", "close"),
            ("_wandb", "finish"),
            ("_file", "close"),
        )
        for name, end in ends:
            sink = getattr(self, name)
            if sink is not None:
                getattr(sink, end)()
                setattr(self, name, None)


def is_terminal(stream: Any) -> bool:
    """Whether `stream` is a terminal (a file or pipe is not)."""
    return bool(getattr(stream, "isatty", lambda: False)())


def terminal_width(stream: Any) -> int | None:
    """Columns of the terminal behind `stream` (0 on some consoles), None when unknown."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def bar_postfix(record: dict[str, Any], loss_name: str) -> str:
    """The progress bar's figures: loss, learning rate, grad norm, tokens/s."""
    pieces = []
    for label, key, fmt in (
        ("loss", loss_name, ".4f"),
        ("lr", "lr", ".2e"),
        ("grad norm", "grad_norm", ".3f"),
        ("tokens/s", "tokens_per_s", ".0f"),
    ):
        value = record.get(key)
        if isinstance(value, (int, float)):
            pieces.append(f"{label} {value:{fmt}}")
    return " ".join(pieces)


def format_eta(seconds: float) -> str:
    """h:mm:ss (days as hours)."""
    total = max(0, round(seconds))
    return f"{total // 3600}:{total // 60 % 60:02d}:{total % 60:02d}"


def _label(name: str) -> str:
    """A loss report name as Megatron prints it: lm_loss -> "lm loss"."""
    return name.replace("_", " ")


def format_log_line(
    record: dict[str, Any],
    train_iters: int | None,
    loss_names: tuple[str, ...] = ("lm_loss",),
    log_throughput: bool = False,
    world_size: int = 1,
) -> str:
    """Megatron-style `iteration  N/ M | ... |` line, ending with the time left at this pace
    (ETA) when `train_iters` is known; `log_throughput` adds the model TFLOP/s per GPU (per
    process on CPU)."""
    total = train_iters if train_iters is not None else "?"
    parts = [f" iteration {record['iteration']:8d}/{total:>8}"]

    def add(label: str, key: str, fmt: str) -> None:
        value = record.get(key)
        parts.append(f"{label}: {'n/a' if value is None else format(value, fmt)}")

    add("consumed samples", "consumed_samples", "12d")
    parts.append(f"elapsed time per iteration (ms): {1000 * record['iteration_time_s']:.1f}")
    if log_throughput:
        total = record.get("tflops_per_s")
        per_gpu = "n/a" if total is None else f"{total / max(world_size, 1):.1f}"
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {per_gpu}")
    add("tokens/s", "tokens_per_s", ".1f")
    mfu_value = record.get("mfu")
    parts.append("MFU: n/a" if mfu_value is None else f"MFU: {100 * mfu_value:.1f}%")
    add("learning rate", "lr", ".6E")
    add("global batch size", "global_batch_size", "5d")
    for name in loss_names:
        add(_label(name), name, ".6E")
    add("loss scale", "loss_scale", ".1f")
    add("grad norm", "grad_norm", ".3f")
    if "params_norm" in record:
        add("params norm", "params_norm", ".3f")
    add("number of skipped iterations", "skipped_iterations", "3d")
    if isinstance(train_iters, int) and record.get("iteration_time_s") is not None:
        # Remaining iterations at this window's pace.
        remaining = max(0, train_iters - record["iteration"]) * record["iteration_time_s"]
        parts.append(f"ETA: {format_eta(remaining)}")
    return " | ".join(parts) + " |"


def format_timers_line(record: dict[str, Any]) -> str:
    """The phase timers of a train record (`time_<name>_ms`), summed over the log interval."""
    timers = [
        (key[len("time_") : -len("_ms")], value)
        for key, value in record.items()
        if key.startswith("time_") and key.endswith("_ms") and value is not None
    ]
    shown = " | ".join(f"{name}: {value:.1f}" for name, value in timers) or "none yet"
    return f" time in the last log interval (ms): {shown} |"


def _open_tensorboard(directory: str, warn) -> Any:
    try:
        # why: optional logger (an extra), loaded only when asked for
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warn(
            f"--tensorboard-dir {directory}: the tensorboard package is not installed "
            "(pip install tensorboard); TensorBoard logging is off"
        )
        return None
    return SummaryWriter(log_dir=directory, max_queue=1000)


def _open_wandb(project: str, name: str | None, warn) -> Any:
    try:
        # why: optional logger (an extra), loaded only when asked for
        import wandb
    except ImportError:
        warn(
            f"--wandb-project {project}: the wandb package is not installed (pip install wandb); "
            "Weights & Biases logging is off"
        )
        return None
    return wandb.init(project=project, name=name)


# ---- sizes of what a rank holds ------------------------------------------------------------
def memory_footprint(model_chunks: list[nn.Module], optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (fp32 main copies of
    bf16/fp16 parameters count as optimizer state), under the start-up record's key names."""
    sizes = memory_bytes_per_rank(model_chunks, optimizer)
    return {
        "parameter_bytes": sizes["params"],
        "gradient_bytes": sizes["grads"],
        "optimizer_state_bytes": sizes["optimizer_state"],
    }


def count_parameters_by_kind(
    model_chunks: list[nn.Module], pctx: ParallelContext, trainable_only: bool = False
) -> tuple[int, int]:
    """(dense, expert) parameters of the whole model: every tensor-, pipeline- and
    expert-parallel shard once (the rule of the gradient norm, optim/clip_grads.py); with
    `trainable_only` those with requires_grad only (LoRA freezes the rest)."""

    local = [0, 0]
    seen: set[int] = set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if trainable_only and not p.requires_grad:
                continue
            if id(p) not in seen and counts_in_norm(p, pctx):
                seen.add(id(p))
                local[is_expert(p)] += p.numel()
    dense, expert = (torch.tensor([n], dtype=torch.float64, device=pctx.device) for n in local)
    reduced_dense = reduce_model_statistic(dense, torch.zeros_like(expert), pctx, None)
    reduced_expert = reduce_model_statistic(torch.zeros_like(dense), expert, pctx, None)
    return int(reduced_dense.item()), int(reduced_expert.item())


def count_parameters(model_chunks: list[nn.Module], pctx: ParallelContext) -> int:
    """Parameters of the whole model (all tensor-, pipeline- and expert-parallel shards, each
    once)."""
    return sum(count_parameters_by_kind(model_chunks, pctx))


def count_active_parameters(
    model_chunks: list[nn.Module], pctx: ParallelContext, topk: int, num_experts: int
) -> int:
    """Parameters one token uses: the dense ones and topk of every MoE layer's experts."""
    dense, expert = count_parameters_by_kind(model_chunks, pctx)
    return dense + expert * topk // num_experts


def gather_from_ranks(value: Any, pctx: ParallelContext) -> list[Any]:
    """Every rank's `value`, in rank order (a list of one outside torch.distributed)."""
    if not dist.is_initialized() or pctx.world_size == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
