"""training/run.py: build_run as pretrain and finetune use it, the arguments printout, the config
written beside the checkpoint (read back by --config), the thread choice, and the log line."""

from __future__ import annotations

import io

import pytest
import torch
import yaml

from gigatron.config.root import config_to_dict
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.training import run as run_module
from gigatron.training.metrics import MetricsLogger, bar_postfix, format_eta, format_log_line
from gigatron.training.pretrain import parse_pretrain_config, pretrain
from gigatron.training.run import (
    CONFIG_FILENAME,
    build_run,
    choose_threads,
    format_arguments,
    write_run_config,
)

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
    "--vocab-size", "128", "--eval-iters", "1", "--eval-interval", "3", "--log-interval", "1",
    "--device", "cpu", "--seed", "7",
]  # fmt: skip


def test_config_beside_the_checkpoint_reads_back_the_same(tmp_path):
    save = tmp_path / "ckpt"
    cfg = parse_pretrain_config([*FLAGS, "--save", str(save)], world_size=1)
    out = io.StringIO()
    result, _ = pretrain(cfg, stream=out, progress_bar=False)
    assert result.iteration == 3
    written = yaml.safe_load((save / CONFIG_FILENAME).read_text())
    assert written == config_to_dict(cfg)
    again = parse_pretrain_config(["--config", str(save / CONFIG_FILENAME)], world_size=1)
    assert config_to_dict(again) == config_to_dict(cfg)
    assert again.model.hidden_size == 64 and again.training.train_iters == 3
    # A run from the written config alone gives the same losses.
    rerun = ["--config", str(save / CONFIG_FILENAME), "--save", str(tmp_path / "second")]
    second, _ = pretrain(
        parse_pretrain_config(rerun, world_size=1), stream=io.StringIO(), progress_bar=False
    )
    assert second.train_losses == result.train_losses
    # The arguments block came first, once, with every value.
    text = out.getvalue()
    assert text.startswith(format_arguments(cfg).splitlines()[0])
    assert text.count("run arguments") == 1
    # Non-terminal output: Megatron's log line with the time left.
    lines = [line for line in text.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 3 and all("grad norm:" in line and "ETA: " in line for line in lines)
    assert lines[-1].endswith("| ETA: 0:00:00 |")


def test_format_arguments_lists_every_field_sorted():
    cfg = parse_pretrain_config(FLAGS, world_size=1)
    lines = format_arguments(cfg).splitlines()
    body = lines[1:-1]
    names = [line.split()[0] for line in body]
    fields = {k for section in config_to_dict(cfg).values() for k in section}
    assert names == sorted(fields)
    assert "  hidden_size " in next(line for line in body if line.split()[0] == "hidden_size")
    assert next(line for line in body if line.split()[0] == "hidden_size").endswith(" 64")
    assert "arguments" in lines[0] and "end of arguments" in lines[-1]


def test_build_run_assembles_and_prints_on_rank_0(tmp_path):
    cfg = parse_pretrain_config([*FLAGS, "--save", str(tmp_path)], world_size=1)
    printed: list[str] = []
    seen: list[int] = []
    parts = build_run(
        cfg, get_family("gpt"), print_line=printed.append,
        prepare=lambda p: seen.append(p.calculator.global_batch_size),
    )  # fmt: skip
    try:
        assert seen == [4]  # prepare runs with the calculator, before the model
        assert len(printed) == 1 and printed[0] == format_arguments(cfg)
        assert parts.train_iters == 3 and parts.state.iteration == 0 and parts.loaded is None
        assert isinstance(parts.model[0], DistributedDataParallel)
        assert parts.scheduler.optimizer is parts.optimizer
        in_optimizer = sum(p.numel() for g in parts.optimizer.param_groups for p in g["params"])
        assert in_optimizer == sum(p.numel() for p in parts.model[0].module.parameters())
        assert parts.rng_tracker is parts.model[0].module.rng
        assert (tmp_path / CONFIG_FILENAME).is_file()
        assert parts.tokenizer.vocab_size == 128
    finally:
        parts.close()


def test_write_run_config_only_with_save(tmp_path):
    cfg = parse_pretrain_config(FLAGS, world_size=1)
    assert write_run_config(cfg, None, ParallelContext.single()) is None
    path = write_run_config(cfg, str(tmp_path / "new"), ParallelContext.single())
    assert path == str(tmp_path / "new" / CONFIG_FILENAME)
    assert yaml.safe_load(open(path).read())["model"]["num_layers"] == 2
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(GigatronError, match=r"--save .*file/sub: cannot write config.yaml"):
        write_run_config(cfg, str(blocker / "sub"), ParallelContext.single())


def test_thread_choice():
    assert choose_threads({}, 2) == 1
    assert choose_threads({}, 1) == 1
    assert choose_threads({}, 6) == 3
    assert choose_threads({}, 64) == run_module.MAX_DEFAULT_THREADS == 4
    assert choose_threads({"OMP_NUM_THREADS": "8"}, 64) is None  # the user's choice stands
    assert choose_threads({"WORLD_SIZE": "2"}, 64) is None  # torchrun sets 1 per process
    before = torch.get_num_threads()
    try:
        assert run_module.apply_thread_choice({"OMP_NUM_THREADS": "3"}) == before
        chosen = choose_threads({}, len(__import__("os").sched_getaffinity(0)))
        assert run_module.apply_thread_choice({}) == chosen
    finally:
        torch.set_num_threads(before)


def _record(iteration: int) -> dict:
    return {
        "iteration": iteration, "consumed_samples": 4 * iteration, "lm_loss": 2.5, "lr": 1e-3,
        "grad_norm": 0.75, "loss_scale": 1.0, "iteration_time_s": 0.5, "tokens_per_s": 1234.0,
        "skipped_iterations": 0, "global_batch_size": 4,
    }  # fmt: skip


def test_log_line_eta():
    assert format_eta(0) == "0:00:00" and format_eta(3725.4) == "1:02:05"
    line = format_log_line(_record(4), 10)  # 6 iterations left at 0.5 s
    assert line.endswith("| grad norm: 0.750 | number of skipped iterations:   0 | ETA: 0:00:03 |")
    assert "ETA" not in format_log_line(_record(4), None)


class _Console(io.StringIO):
    def __init__(self, columns: int | None) -> None:
        super().__init__()
        self.columns = columns

    def isatty(self) -> bool:
        return True


def test_bar_shows_grad_norm_and_tokens_per_s_and_zero_width_prints_lines(tmp_path, monkeypatch):
    assert (
        bar_postfix(_record(1), "lm_loss")
        == "loss 2.5000 lr 1.00e-03 grad norm 0.750 tokens/s 1234"
    )
    monkeypatch.setattr("gigatron.training.metrics.terminal_width", lambda stream: stream.columns)
    for columns, bar in ((None, True), (80, True), (0, False)):
        out = _Console(columns)
        logger = MetricsLogger(
            str(tmp_path / f"{columns}.jsonl"), ParallelContext.single(), 10, stream=out
        )
        logger.log_iteration(_record(5), train_iters=10)
        logger.close()
        text = out.getvalue()
        if bar:
            assert "5/10" in text and "grad norm 0.750 tokens/s 1234" in text
            assert " iteration " not in text
        else:
            assert text.startswith(" iteration        5/      10 |") and "ETA: 0:00:02" in text


def test_evaluate_progress_off_a_terminal_prints_lines_with_eta():
    from gigatron.tasks.evaluate import Progress

    out = io.StringIO()
    progress = Progress("LAMBADA", True, stream=out)
    progress.LINE_EVERY_S = 0.0  # a line for every batch
    progress(1, 4)
    progress(4, 4)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0].startswith("LAMBADA: 1/4 batches (") and "| ETA: 0:00:0" in lines[0]
    assert lines[1].startswith("LAMBADA: 4/4 batches (") and lines[1].endswith("| ETA: 0:00:00")
    terminal = _Console(80)
    Progress("LAMBADA", True, stream=terminal)(1, 4)  # no fileno: width unknown, in place
    assert terminal.getvalue().startswith("\rLAMBADA: 1/4 batches (")


def test_quickstart_plot_title_says_where_the_time_limit_stopped():
    from gigatron.quickstart import build_parser, plot_title

    args = build_parser().parse_args(["--iterations", "800", "--minutes", "3.5"])
    full = plot_title(args, 2_500_000, 800)
    assert full.endswith("lr 0.002, 800 iterations") and "2.50M parameters" in full
    assert plot_title(args, None, 34).endswith("lr 0.002, 34 of 800 iterations (--minutes 3.5)")


def test_log_window_averages_each_loss_over_the_iterations_that_had_it():
    from gigatron.training.loop import LogWindow, StepResult

    window = LogWindow.empty(("lm_loss", "mtp_loss"))
    window.add(StepResult({"lm_loss": 2.0, "mtp_loss": 4.0}, True, 1.0, None), 0.5, 8, 10.0)
    window.add(StepResult({"lm_loss": 3.0}, False, None, None), 1.5, 16, 30.0)
    assert window.mean_losses() == {"lm_loss": 2.5, "mtp_loss": 4.0}
    assert (window.iterations, window.time, window.samples, window.flops) == (2, 2.0, 24, 40.0)
    assert LogWindow.empty(("lm_loss",)).mean_losses() == {"lm_loss": None}
