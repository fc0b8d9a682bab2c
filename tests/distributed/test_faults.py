"""Faults of multi-process runs (gigatron/faults.py): every group gets the configured timeout and
a stopped peer (SIGSTOP) becomes a message naming the collective and the rank; an error that every rank hits
is printed once."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gigatron.faults import DistributedFault, name_distributed_failures, report_error
from gigatron.parallel.context import ParallelContext, run_distributed

pytestmark = pytest.mark.distributed

TIMEOUT_S = 2.0


def _stuck_peer(rank: int, world_size: int, out: str) -> None:
    # Every group of the context must carry the short timeout (the default group does not).
    pctx = ParallelContext.from_sizes(tp=2, timeout_minutes=TIMEOUT_S / 60)
    assert pctx.timeout is not None and pctx.timeout.total_seconds() == pytest.approx(TIMEOUT_S)
    if rank == 1:  # stopped by SIGSTOP: never joins the all-reduce nor checks in
        Path(out + ".pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # rank 0 wakes it up (SIGCONT) once it has named it
    try:
        Path(out).write_text(json.dumps(_all_reduce_with_a_stopped_peer(pctx)))
    finally:  # wake the stopped peer whatever happened, or the test would wait for it forever
        pid_file, deadline = Path(out + ".pid"), time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(int(pid_file.read_text()), signal.SIGCONT)


def _all_reduce_with_a_stopped_peer(pctx: ParallelContext) -> dict:
    start = time.monotonic()

    def reduce() -> None:
        pctx.all_reduce(torch.ones(1), "tp")

    try:
        name_distributed_failures(reduce)
    except DistributedFault as fault:
        return {"message": str(fault), "elapsed": time.monotonic() - start}
    return {"message": None, "elapsed": time.monotonic() - start}


def test_a_stopped_peer_times_out_with_the_collective_and_the_rank_named(tmp_path):
    out = tmp_path / "rank0.json"
    run_distributed(_stuck_peer, 2, str(out))
    result = json.loads(out.read_text())
    assert result["message"] is not None, "the all-reduce did not fail"
    # The timeout of the group (2 s), plus the check-in wait: not torch's 30-minute default.
    assert result["elapsed"] < TIMEOUT_S + 7.0
    message = result["message"]
    assert message.startswith("rank 0: all_reduce at gigatron/parallel/context.py")
    assert "timed out after 2 s" in message
    assert "in the group of ranks [0, 1]" in message
    assert "rank 1 did not answer" in message
    assert "--distributed-timeout-minutes" in message


def _report(rank: int, world_size: int, directory: str) -> None:
    stream = io.StringIO()
    done = torch.zeros(1)
    if rank < 2:
        status = report_error("pretrain", "--hidden-size 30: not divisible by 4", stream=stream)
        dist.send(done, dst=2)
    else:  # rank 2 comes last, with another error: after the quiet one of ranks 0 and 1 has
        # left (the first one waits in report_error until every other rank has settled)
        dist.recv(done)
        status = report_error("pretrain", "rank 2's own problem", stream=stream)
        dist.recv(done)
    dist.barrier()  # rank 0 holds the store: it stays until every rank is done with it
    Path(directory, f"{rank}.json").write_text(
        json.dumps({"status": status, "printed": stream.getvalue()})
    )


def test_an_error_every_rank_hits_is_printed_once(tmp_path):
    run_distributed(_report, 3, str(tmp_path))
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    same = results[:2]
    printed = [r["printed"] for r in same if r["printed"]]
    # Ranks 0 and 1 hit the same error: one of them prints it and fails, the other is quiet.
    assert printed == ["gigatron pretrain: error: --hidden-size 30: not divisible by 4\n"]
    assert sorted(r["status"] for r in same) == [0, 2]
    # Rank 2's error is another one: it is printed too, with the rank named.
    assert results[2] == {
        "status": 2,
        "printed": "[rank 2] gigatron pretrain: error: rank 2's own problem\n",
    }
