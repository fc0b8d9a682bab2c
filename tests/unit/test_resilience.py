"""Result validation (training/resilience.py, `--rerun-mode`): a rejected iteration is re-run
from the same state; not reproduced -> a transient fault, training goes on with the losses of an
undisturbed run; reproduced -> the run stops naming the iteration and the micro-batch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from test_training_loop import ToyLM, make_run

from gigatron.errors import GigatronError
from gigatron.training.loop import train
from gigatron.training.resilience import ErrorInjector, ReplayIterator, SpikeDetector


def _toy(dropout: float = 0.0) -> ToyLM:
    """A toy model initialised as make_run initialises its own (seed 0)."""
    torch.manual_seed(0)
    return ToyLM(dropout)


def _poison_once(toy: ToyLM, call: int) -> None:
    """The forward pass number `call` (and only it) gives an infinite loss."""
    toy.on_call = lambda n: setattr(toy, "poison_at_call", call if n == call else None)


def _messages(run) -> str:
    return run.metrics.stream.getvalue()


def test_a_transient_nan_is_re_run_and_training_matches_an_undisturbed_run(tmp_path):
    clean = train(make_run(tmp_path / "clean", toy=_toy(0.2))).train_losses
    toy = _toy(0.2)  # dropout: the re-run must restore the random states too
    _poison_once(toy, 5)  # 2 micro-batches an iteration: iteration 3's first forward
    run = make_run(tmp_path / "faulty", toy=toy)
    result = train(run)
    assert result.train_losses == clean  # bit for bit, the re-run's gradients were used
    found = re.search(r"iteration 3: the lm loss is (nan|inf) \(not finite\); a re-run from the "
                      r"same state gave lm loss ([0-9.]+): a transient fault", _messages(run))  # fmt: skip
    assert found and float(found.group(2)) == clean[3]
    assert "a transient fault" in _messages(run) and result.iteration == 4


def test_a_repeating_nan_stops_naming_the_iteration_and_the_micro_batch(tmp_path):
    toy = _toy()
    toy.on_call = lambda n: setattr(toy, "poison_at_call", n if n % 2 == 0 else None)
    saved: list[int] = []
    run = make_run(tmp_path, "--save", str(tmp_path / "ckpt"), "--save-interval", "1", toy=toy,
                   saved=saved)  # fmt: skip
    with pytest.raises(GigatronError) as error:
        train(run)
    message = str(error.value)
    assert re.match(
        r"iteration 1: the lm loss is (nan|inf) \(not finite\), reproduced by a ", message
    )
    assert "(micro-batch 1 of data-parallel rank 0)" in message
    assert "--iterations-to-skip 0" in message and saved == []


def test_rerun_mode_disabled_stops_at_once(tmp_path):
    toy = _toy()
    toy.poison_at_call = 5
    run = make_run(tmp_path, "--rerun-mode", "disabled", toy=toy)
    with pytest.raises(
        GigatronError, match=r"iteration 3: the lm loss is (nan|inf) .*--rerun-mode dis"
    ):
        train(run)
    assert toy.calls == 6  # no re-run: iterations 1, 2 and the first of 3 (2 forwards each)


def test_injected_errors_transient_and_persistent(tmp_path):
    clean = train(make_run(tmp_path / "clean")).train_losses
    run = make_run(tmp_path / "t", "--error-injection-rate", "1")  # every iteration
    assert train(run).train_losses == clean
    assert _messages(run).count("an injected error (--error-injection-type transient_error)") == 4
    run = make_run(tmp_path / "p", "--error-injection-rate", "1", "--error-injection-type",
                   "persistent_error")  # fmt: skip
    with pytest.raises(GigatronError, match="iteration 1: an injected error .*reproduced by a"):
        train(run)


def test_report_stats_re_runs_every_iteration(tmp_path):
    toy = _toy(0.2)
    run = make_run(tmp_path, "--rerun-mode", "report_stats", "--log-interval", "2",
                   "--eval-iters", "0", toy=toy)  # fmt: skip
    result = train(run)
    assert toy.calls == 4 * 2 * 2  # every iteration twice
    assert result.train_losses == train(make_run(tmp_path / "c", toy=_toy(0.2))).train_losses
    lines = [line for line in _messages(run).splitlines() if "report_stats" in line]
    assert lines == ["result validation (report_stats): 2 iteration(s) re-run, 0 differed, "
                     "largest relative lm loss difference 0"] * 2  # fmt: skip


def test_iterations_to_skip_consume_the_batch_without_an_update(tmp_path):
    toy = _toy()
    run = make_run(tmp_path, "--iterations-to-skip", "1", "--eval-iters", "0", toy=toy)
    result = train(run)
    assert sorted(result.train_losses) == [1, 3, 4] and run.state.skipped_iterations == 1
    assert toy.calls == 3 * 2 and run.state.consumed_train_samples == 4 * 4
    assert "iteration 2 skipped (--iterations-to-skip)" in _messages(run)


def test_spike_detector_and_helpers():
    spikes = SpikeDetector(factor=10, samples=3)
    assert [spikes.is_spike(v) for v in (2.0, 3.0, float("nan"), 1.0, 29.0, 30.0)] == [
        False, False, False, False, False, True
    ]  # fmt: skip
    replay = ReplayIterator(iter(range(10)))
    replay.start_iteration()
    first = [next(replay), next(replay)]
    replay.rewind()
    assert [next(replay), next(replay), next(replay)] == [*first, 2]
    injector = ErrorInjector(3, "persistent_error", seed=1)
    picks = [injector.first_run() for _ in range(300)]
    assert 60 < sum(picks) < 140 and injector.rerun() == picks[-1]


# A worker process that kills itself (SIGKILL) at the third sample. In a process of its own:
# torch's SIGCHLD handler keeps watching a dead worker's pid while the error holds its iterator,
# and would raise again when any later child of the test process exits.
_DYING_LOADER = """
import os, signal, torch
from gigatron.faults import DataLoaderFault, name_distributed_failures

class Dying(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, index):
        if index == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([index])

try:
    name_distributed_failures(list, torch.utils.data.DataLoader(Dying(), num_workers=1))
except DataLoaderFault as fault:
    print(f"{fault.exit_code}|{fault}", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("trial", range(3))
def test_a_dead_data_loader_worker_is_one_line_not_a_traceback(trial):
    """Three trials: the worker may die before, during or after handing a batch over."""
    result = subprocess.run(
        [sys.executable, "-c", _DYING_LOADER], capture_output=True, text=True, timeout=120
    )
    code, _, message = result.stdout.strip().partition("|")
    assert code == "1", result.stdout + result.stderr
    assert message.startswith("a data-loader worker process died (DataLoader worker (pid")
    assert "--num-workers" in message and "\n" not in message
