"""`gigatron pretrain gpt` end to end: metrics records, resume equality, deterministic repeats,
the stop on a non-finite loss, and save-and-exit on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch

import helpers
from gigatron.errors import GigatronError
from gigatron.training.pretrain import main as pretrain_main
from helpers import (
    env,
    gigatron_command,
    records,
    tiny_gpt_flags,
    train_values,
    wait_for_train_record,
)

TINY = [
    *tiny_gpt_flags(hidden_size=32), "--global-batch-size", "4", "--lr", "1e-3", "--train-iters",
    "8", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1", "--num-workers", "0",
    "--deterministic-mode",
]  # fmt: skip


def pretrain(*flags: str, check: bool = True) -> subprocess.CompletedProcess:
    return helpers.pretrain("gpt", *TINY, *flags, check=check, timeout=120)


def train_losses(directory: Path) -> dict[int, float]:
    return train_values(directory)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """8 iterations saving at 4 and 8 (the reference for resume and determinism)."""
    directory = tmp_path_factory.mktemp("full")
    pretrain("--save", str(directory), "--save-interval", "4")
    return directory


def test_metrics_records(full_run):
    all_records = records(full_run)
    startup = [r for r in all_records if r["type"] == "startup"]
    assert len(startup) == 1
    # 2 layers of hidden 32 (+ biases, norms), 128 x 32 tied embedding, 16 x 32 positions.
    layer = 4 * 32 * 32 + 4 * 32 + 8 * 32 * 32 + 4 * 32 + 32 + 4 * 32
    assert startup[0]["parameters"] == 2 * layer + 128 * 32 + 16 * 32 + 2 * 32
    (entry,) = startup[0]["bytes_per_rank"]
    assert entry["parameter_bytes"] == 4 * startup[0]["parameters"]
    assert entry["gradient_bytes"] == 4 * startup[0]["parameters"]
    assert entry["optimizer_state_bytes"] >= 2 * 4 * startup[0]["parameters"]
    train = [r for r in all_records if r["type"] == "train"]
    assert [r["iteration"] for r in train] == list(range(1, 9))
    assert [r["consumed_samples"] for r in train] == [4 * i for i in range(1, 9)]
    for r in train:
        for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "iteration_time_s",
                    "tokens_per_s"):  # fmt: skip
            assert isinstance(r[key], float), key
        assert r["mfu"] is None and r["skipped_iterations"] == 0
    # Random tokens: the loss starts near ln(128) = 4.85.
    assert abs(train[0]["lm_loss"] - 4.852) < 0.1
    assert train[0]["lr"] == pytest.approx(1e-3 * 7 / 8)  # linear decay over 8 iterations
    evals = [(r["split"], r["iteration"]) for r in all_records if r["type"] == "eval"]
    assert evals == [("valid", 4), ("valid", 8), ("test", 8)]
    assert (full_run / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert (full_run / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").is_file()


@pytest.fixture
def in_process():
    """Run `gigatron pretrain gpt` in this process (saves the interpreter start-up); restores
    the global switch that --deterministic-mode turns on."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    # Same thread count as the subprocesses (OMP_NUM_THREADS=1): CPU reductions split over
    # threads differently round differently.
    torch.set_num_threads(1)

    def run(*flags: str) -> int:
        return pretrain_main(["gpt", *TINY, *flags])

    yield run
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


def test_resume_continues_bitwise(full_run, tmp_path, in_process):
    assert in_process("--save", str(tmp_path), "--exit-interval", "4") == 0
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert max(train_losses(tmp_path)) == 4
    assert in_process("--save", str(tmp_path), "--load", str(tmp_path)) == 0
    resumed, reference = train_losses(tmp_path), train_losses(full_run)
    assert [resumed[i] for i in range(5, 9)] == [reference[i] for i in range(5, 9)]


def test_deterministic_mode_repeats_bitwise(full_run, tmp_path, in_process):
    # The reference ran in another process: equal losses there and here, bit for bit.
    in_process("--save", str(tmp_path), "--save-interval", "4")
    assert train_losses(tmp_path) == train_losses(full_run)
    evals = [r["lm_loss"] for r in records(tmp_path) if r["type"] == "eval"]
    assert evals == [r["lm_loss"] for r in records(full_run) if r["type"] == "eval"]


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path, in_process):
    with pytest.raises(GigatronError, match="iteration 2: the lm loss is nan") as error:
        in_process("--lr", "1e30", "--clip-grad", "0", "--save", str(tmp_path),
                   "--save-interval", "1")  # fmt: skip
    assert "last good checkpoint" in str(error.value)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (tmp_path / "iter_0000002").exists()


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    command = gigatron_command(
        "pretrain", "gpt", *TINY, "--train-iters", "100000",
        "--exit-signal-handler", "--save", str(tmp_path), "--metrics-file",
        str(tmp_path / "metrics.jsonl"),
    )  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )
    try:
        wait_for_train_record(tmp_path / "metrics.jsonl", process, 60)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    saved = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= saved < 100000
    assert f"exiting at iteration {saved} (signal)" in stdout
    assert (tmp_path / f"iter_{saved:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_unknown_family_lists_the_known_ones():
    with pytest.raises(GigatronError, match="llama: unknown model family; choose one of .*gpt"):
        pretrain_main(["llama"])


# Per-token loss with plain SGD: the gradients are divided by the token count of both replicas.
PER_TOKEN_SGD = ["--calculate-per-token-loss", "--optimizer", "sgd", "--lr", "0.5"]
DATA_PARALLEL = {"mean": [], "per-token-sgd": PER_TOKEN_SGD}
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """Both torchrun runs (dp = 2) in one launch, each in `<root>/<name>`."""
    root = tmp_path_factory.mktemp("dp2")
    runs = {
        name: (2, ["pretrain", "gpt", *TINY, *NO_DROPOUT, *extra, "--save", str(root / name)])
        for name, extra in DATA_PARALLEL.items()
    }
    helpers.gigatron_runs(root, runs)
    return root


@pytest.mark.parametrize("name", list(DATA_PARALLEL))
def test_torchrun_data_parallel_matches_one_process(tmp_path, in_process, two_processes, name):
    """Two processes on Gloo (dp = 2) train like one: same losses, every record written once."""
    extra = DATA_PARALLEL[name]
    assert in_process("--save", str(tmp_path / "one"), *NO_DROPOUT, *extra) == 0
    one, two = train_losses(tmp_path / "one"), train_losses(two_processes / name)
    assert sorted(two) == [1, 2, 3, 4]
    assert [two[i] for i in range(1, 5)] == pytest.approx([one[i] for i in range(1, 5)], rel=1e-5)
    (startup,) = records(two_processes / name, "startup")
    assert startup["dp"] == 2 and [e["rank"] for e in startup["bytes_per_rank"]] == [0, 1]
