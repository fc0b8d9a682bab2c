"""The pretraining sampler: global order, data-parallel slices, resumption, cycling."""

from __future__ import annotations

import itertools
import multiprocessing

import numpy as np
import pytest
import torch

from gigatron.data.loader import PretrainingBatchSampler, build_data_iterator
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext


class IndexDataset:
    """Sample k holds k, so batches show which samples they contain."""

    def __init__(self, size: int, seq: int = 4) -> None:
        self.size, self.seq = size, seq

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        return {
            "tokens": np.full(self.seq, k, dtype=np.int64),
            "loss_mask": np.ones(self.seq, dtype=np.float32),
        }


def sample_ids(iterator, count):
    return [batch["tokens"][:, 0].tolist() for batch in itertools.islice(iterator, count)]


def test_single_rank_order_and_stacking():
    iterator = build_data_iterator(IndexDataset(10), 3, 0, ParallelContext.single())
    first = next(iterator)
    assert first["tokens"].shape == (3, 4) and first["tokens"].dtype == torch.int64
    assert first["loss_mask"].dtype == torch.float32
    assert first["tokens"][:, 0].tolist() == [0, 1, 2]
    assert sample_ids(iterator, 5) == [[3, 4, 5], [6, 7, 8]]  # the incomplete last batch drops


def test_data_parallel_slices():
    dataset = IndexDataset(40)
    streams = [
        sample_ids(build_data_iterator(dataset, 2, 0, None, 0, 3, rank), 100) for rank in range(3)
    ]
    # every block of 2 x 3 samples: rank r takes [6b + 2r, 6b + 2r + 1]
    assert streams[0][:2] == [[0, 1], [6, 7]]
    assert streams[1][:2] == [[2, 3], [8, 9]]
    assert streams[2][:2] == [[4, 5], [10, 11]]
    assert all(len(s) == 40 // 6 for s in streams)
    together = sorted(k for s in streams for batch in s for k in batch)
    assert together == list(range(36))


def test_resume_continues_the_same_stream():
    dataset = IndexDataset(100)
    for dp_rank in range(2):
        whole = sample_ids(build_data_iterator(dataset, 3, 0, None, 0, 2, dp_rank), 100)
        consumed = 5 * 3 * 2  # five iterations of one micro-batch on two ranks
        resumed = sample_ids(build_data_iterator(dataset, 3, consumed, None, 0, 2, dp_rank), 100)
        assert whole[:5] + resumed == whole


def test_cycle_restarts_for_evaluation():
    iterator = build_data_iterator(IndexDataset(7), 3, 0, None, cycle=True)
    assert sample_ids(iterator, 5) == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert build_data_iterator(None, 3, 0, None) is None


def test_worker_processes_give_the_same_batches():
    dataset = IndexDataset(12)
    plain = sample_ids(build_data_iterator(dataset, 2, 0, None, num_workers=0), 6)
    workers = sample_ids(build_data_iterator(dataset, 2, 0, None, num_workers=1), 6)
    assert plain == workers == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_workers_are_forked_under_a_forkserver_default():
    """Python 3.14 makes forkserver the default start method on Linux; the workers are still
    forked from the main process, which they watch (gigatron/faults.py): under a forkserver
    their parent would be the server and they would exit at once."""
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        iterator = build_data_iterator(IndexDataset(12), 2, 0, None, num_workers=1)
        workers = sample_ids(iterator, 6)
    finally:
        multiprocessing.set_start_method(previous, force=True)
    assert workers == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_errors():
    with pytest.raises(GigatronError, match="consumed samples"):
        PretrainingBatchSampler(10, 10, 2, 0, 1)
    with pytest.raises(GigatronError, match="--micro-batch-size"):
        PretrainingBatchSampler(10, 0, 0, 0, 1)
    with pytest.raises(GigatronError, match="fewer than one micro-batch"):
        build_data_iterator(IndexDataset(3), 4, 0, None, cycle=True)


def test_gpt_samples_through_the_loader():
    from gigatron.config import GigatronConfig
    from gigatron.data.gpt_dataset import build_gpt_datasets
    from gigatron.data.tokenizers import NullTokenizer

    cfg = GigatronConfig()
    cfg.model.seq_length = 16
    cfg.data.mock_data = True
    cfg.data.reset_attention_mask = True
    train = build_gpt_datasets(cfg, NullTokenizer(vocab_size=50), (8, 0, 0))[0]
    batch = next(build_data_iterator(train, 4, 0, None))
    assert batch["tokens"].shape == (4, 16) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["attention_mask"].shape == (4, 1, 16, 16)
    assert batch["attention_mask"].dtype == torch.bool
    for row in range(4):
        np.testing.assert_array_equal(batch["tokens"][row].numpy(), train[row]["tokens"])
