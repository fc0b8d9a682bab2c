"""`gigatron pretrain` under torchrun (2 ranks, one launch): an injected transient fault in
every iteration is re-run by all ranks together and the run gives the losses of an undisturbed
run; with --log-straggler a rank made slow is named in the log and in metrics.jsonl."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from helpers import launcher, records, run, tiny_gpt_flags, train_values

pytestmark = pytest.mark.distributed
SLOW_RANK = 1

# The commands of gigatron_sequence.py, then, with rank 1's forward-backward made slow, one more.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    import gigatron_sequence
    from gigatron.training import loop

    first, slow = json.loads(open({spec!r}).read())
    store = dist.FileStore({spec!r} + ".store", int(os.environ["WORLD_SIZE"]))
    status = gigatron_sequence.run_all(first, store)
    if status == 0:
        inner = loop.forward_backward

        def slowed(*args, **kwargs):
            if int(os.environ["RANK"]) == {slow_rank}:
                time.sleep(0.2)
            return inner(*args, **kwargs)

        loop.forward_backward = slowed
        store2 = dist.FileStore({spec!r} + ".store2", int(os.environ["WORLD_SIZE"]))
        status = gigatron_sequence.run_all(slow, store2)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)
    """
)


def _args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["pretrain", "gpt", *tiny_gpt_flags(), "--global-batch-size", "4",
            "--train-iters", "4", "--log-interval", "2", "--lr", "1e-3", "--eval-iters", "0",
            "--metrics-file", str(tmp_path / f"{name}.jsonl"), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resilience")
    first = [
        [str(tmp_path / "clean.out"), _args(tmp_path, "clean")],
        [str(tmp_path / "injected.out"), _args(tmp_path, "injected", "--error-injection-rate", "1")],
    ]  # fmt: skip
    slow = [[str(tmp_path / "slow.out"), _args(tmp_path, "slow", "--log-straggler")]]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([first, slow]))
    script = tmp_path / "launch.py"
    tests = str(Path(__file__).resolve().parents[1])
    script.write_text(SCRIPT.format(tests=tests, spec=str(spec), slow_rank=SLOW_RANK))
    run([*launcher(2), str(script)])
    return tmp_path


def test_a_transient_fault_on_every_iteration_changes_no_loss(runs):
    clean = train_values(runs / "clean.jsonl")
    assert sorted(clean) == [2, 4]
    assert train_values(runs / "injected.jsonl") == clean
    out = (runs / "injected.out").read_text()
    assert out.count("an injected error (--error-injection-type transient_error); a re-run") == 4


def test_a_slow_rank_is_named_by_straggler_detection(runs):
    reports = records(runs / "slow.jsonl", "straggler")
    assert [r["iteration"] for r in reports] == [2, 4]
    for report in reports:
        assert report["slowest_ranks"] == [SLOW_RANK] and report["fastest_ranks"] == [0]
        assert report["compute_ms"][SLOW_RANK] > 200 > report["compute_ms"][0]
        assert report["wait_ms"][0] > report["wait_ms"][SLOW_RANK]
    out = (runs / "slow.out").read_text()
    assert out.count(f"; slowest: rank {SLOW_RANK} (") == 2
