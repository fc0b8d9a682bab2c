"""`torchrun --max-restarts` with --save and --load on one folder: a worker killed with SIGKILL
mid-run is restarted with the others (a new rendezvous round), the run resumes from the newest
checkpoint and ends with the losses of an uninterrupted run, bit for bit (deterministic mode)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers import launcher, run, tiny_gpt_flags, train_values

pytestmark = pytest.mark.distributed

# `gigatron <args>`; in the first round (or every round), rank 1 kills itself (SIGKILL) as
# iteration KILL_AT starts.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from gigatron.cli import main
    from gigatron.training import loop

    kill_at, every_round = int(sys.argv[1]), sys.argv[2] == "every-round"
    first_round = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    if (first_round or every_round) and os.environ["RANK"] == "1":
        step = loop.step_on_device

        def dying(run, num_microbatches):
            if run.state.iteration + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(run, num_microbatches)

        loop.step_on_device = dying
    sys.exit(main(sys.argv[3:]))
    """
)


def _pretrain(tmp_path: Path, name: str, ckpt_format: str) -> list[str]:
    save = str(tmp_path / name)
    return ["pretrain", "gpt", *tiny_gpt_flags(), "--global-batch-size", "4",
            "--train-iters", "6", "--log-interval", "1", "--lr", "1e-3", "--eval-iters", "0",
            "--deterministic-mode", "--save", save, "--load", save, "--save-interval", "2",
            "--ckpt-format", ckpt_format, "--metrics-file", str(tmp_path / f"{name}.jsonl")]  # fmt: skip


@pytest.mark.parametrize("ckpt_format", ["torch_dist"])
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_nothing_happened(
    tmp_path, ckpt_format
):
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    torchrun = [*launcher(2)[:-2], "--nproc-per-node", "2", "--max-restarts", "2"]
    run([*torchrun, str(script), "0", "first-round", *_pretrain(tmp_path, "clean", ckpt_format)])
    result = run(
        [*torchrun, str(script), "5", "first-round", *_pretrain(tmp_path, "killed", ckpt_format)]
    )
    assert "exitcode: -9" in result.stderr  # the first round did lose a worker
    clean = train_values(tmp_path / "clean.jsonl")
    assert sorted(clean) == list(range(1, 7))
    assert train_values(tmp_path / "killed.jsonl") == clean
    assert "loaded checkpoint" in result.stdout and "at iteration 4" in result.stdout
    assert "torchrun restart round 1: round 0 failed in iteration 5; resuming at iteration 5" in (
        result.stdout
    )


def test_a_fault_that_repeats_at_one_iteration_stops_the_restarts_naming_it(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    torchrun = [*launcher(2)[:-2], "--nproc-per-node", "2", "--max-restarts", "2"]
    flags = _pretrain(tmp_path, "repeating", "torch")
    result = run([*torchrun, str(script), "3", "every-round", *flags], check=False)
    assert result.returncode != 0
    assert result.stderr.count("exitcode: -9") == 2  # rounds 0 and 1 lost rank 1
    assert "error: iteration 3 failed in torchrun restart rounds 0 and 1: the fault repeats" in (
        result.stderr
    )
    assert "--iterations-to-skip 2" in result.stderr
