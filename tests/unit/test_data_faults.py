"""Data files that change under a running loader: one line naming the file, with and without
worker processes; worker processes resume at the same sample as the main process; a process
whose loader is still open at exit does not wait forever for its workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from gigatron.data.indexed import IndexedDataset, write_dataset
from gigatron.data.loader import build_data_iterator
from gigatron.errors import GigatronError
from gigatron.faults import DataLoaderFault, describe_data_loader_failure, worker_error_message


class SequenceSamples:
    """Sample k: sequence k of an indexed dataset (every sequence has 8 tokens)."""

    def __init__(self, prefix: str) -> None:
        self.data = IndexedDataset(prefix)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        return {"tokens": self.data.get(k).astype(np.int64)}


@pytest.fixture
def prefix(tmp_path):
    path = str(tmp_path / "corpus")
    write_dataset(path, [[[k * 8 + t for t in range(8)]] for k in range(64)])
    return path


def first_error(iterator, limit: int = 64) -> GigatronError:
    with pytest.raises(GigatronError) as caught:
        for _ in range(limit):
            next(iterator)
    return caught.value


@pytest.mark.parametrize("workers", [0, 1])
def test_a_data_file_truncated_mid_run_is_named_in_one_line(prefix, workers):
    iterator = build_data_iterator(SequenceSamples(prefix), 2, 0, None, num_workers=workers)
    assert next(iterator)["tokens"][:, 0].tolist() == [0, 8]
    os.truncate(prefix + ".bin", 100)
    message = str(first_error(iterator))
    assert message == (
        f"{prefix}.bin: its size changed from 1024 to 100 bytes while the run was reading it "
        "(truncated or rewritten in place); restore the file, then resume from the last "
        "checkpoint with --load"
    )


def test_a_truncated_index_is_named(prefix):
    iterator = build_data_iterator(SequenceSamples(prefix), 2, 0, None, num_workers=0)
    next(iterator)
    os.truncate(prefix + ".idx", 40)
    message = str(first_error(iterator))
    assert message.startswith(f"{prefix}.idx: its size changed from ") and "to 40 bytes" in message


def test_worker_processes_resume_at_the_same_sample(prefix):
    dataset = SequenceSamples(prefix)
    whole = [b["tokens"][:, 0].tolist() for b in build_data_iterator(dataset, 2, 0, None, 0, 2, 1)]
    consumed = 3 * 2 * 2  # three iterations of a micro-batch of 2 on 2 data-parallel ranks
    resumed = build_data_iterator(
        dataset, 2, consumed, None, num_workers=2, data_parallel_size=2, data_parallel_rank=1
    )
    batches = list(resumed)
    assert [b["tokens"][:, 0].tolist() for b in batches] == whole[3:]
    assert whole[3] == [8 * 14, 8 * 15]  # block 3 starts at sample 12, rank 1 takes 14 and 15
    assert all(b["tokens"].dtype == torch.int64 for b in batches)


def test_worker_error_messages():
    wrapped = GigatronError(
        "Caught GigatronError in DataLoader worker process 0.\nOriginal Traceback (most recent "
        'call last):\n  File "x.py", line 1, in f\ngigatron.errors.GigatronError: a.bin: gone'
    )
    assert worker_error_message(wrapped) == "a.bin: gone"
    assert worker_error_message(GigatronError("plain: text")) == "plain: text"
    bus = RuntimeError("DataLoader worker (pid 42) is killed by signal: Bus error. ")
    fault = describe_data_loader_failure(bus)
    assert isinstance(fault, DataLoaderFault)
    assert (
        "memory-mapped data file (DataLoader worker (pid 42) is killed by signal: Bus error)"
        in (str(fault))
    )


EXIT_WITH_AN_OPEN_LOADER = """
import multiprocessing, sys
from gigatron.data.loader import build_data_iterator

class Samples:
    def __len__(self):
        return 64

    def __getitem__(self, k):
        return {"tokens": k}

iterator = build_data_iterator(Samples(), 2, 0, None, num_workers=1)
next(iterator)
print(multiprocessing.active_children()[0].pid, flush=True)
sys.stdin.readline()  # meanwhile the test sends the worker a SIGTERM of its own
print(next(iterator)["tokens"].tolist(), flush=True)
# the interpreter exits with the loader open (as after an error): multiprocessing stops the
# worker with SIGTERM and waits for it
"""


def test_a_worker_ignores_other_senders_sigterm_and_its_process_exits_with_the_loader_open():
    process = subprocess.Popen(
        [sys.executable, "-c", EXIT_WITH_AN_OPEN_LOADER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker = int(process.stdout.readline())
        os.kill(worker, signal.SIGTERM)  # torchrun's SIGTERM to the process group: for the main
        time.sleep(0.5)
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "[2, 3]"  # the worker still serves
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)
