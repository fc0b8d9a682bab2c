"""The generic dataset builder: Megatron-Core's blend sizes (hand-computed), per-split paths,
a dataset class of a test's own, the rank protocol, and the index cache."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pytest

from gigatron.config import GigatronConfig
from gigatron.data.blend import BlendedDataset
from gigatron.data.builder import build_datasets
from gigatron.data.gpt_dataset import GPTDataset, build_gpt_datasets
from gigatron.data.index_cache import IndexCache, describe
from gigatron.data.indexed import write_dataset
from gigatron.data.tokenizers import NullTokenizer
from gigatron.errors import GigatronError

EOD = 99
TOKENIZER = NullTokenizer(vocab_size=EOD + 1)


def fixed_documents(num_docs: int, first: int) -> list[list[np.ndarray]]:
    """Documents of 8 tokens (7 then EOD): a dataset of D documents holds (8D - 1) // 16
    samples in one pass at --seq-length 16."""
    return [[np.append(np.arange(7) + first + i, EOD)] for i in range(num_docs)]


@pytest.fixture
def two(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, fixed_documents(20, 0))  # 160 tokens: 9 samples in one pass
    write_dataset(b, fixed_documents(10, 50))  # 80 tokens: 4 samples in one pass
    return a, b


def config(**data):
    cfg = GigatronConfig()
    cfg.model.seq_length = 16
    cfg.training.seed = 1234
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def test_unweighted_blend_reads_each_member_once_capped_at_the_request(two, tmp_path):
    a, b = two
    cfg = config(data_path=[a, b], split="1,0,0", data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_gpt_datasets(cfg, TOKENIZER, (10, 0, 0))
    assert valid is None and test is None
    assert [m.num_samples for m in train.datasets] == [None, None]  # one pass each
    assert [len(m) for m in train.datasets] == [9, 4]
    # min(10, 9 + 4) samples by the deficit rule with weights 9/13 and 4/13, by hand:
    # i=0: 9/13 vs 4/13 -> a; i=1: -4/13 vs 4/13 -> b; i=2: 5/13 vs -5/13 -> a; ...
    assert len(train) == 10
    assert np.asarray(train.dataset_index).tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert np.asarray(train.dataset_sample_index).tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    np.testing.assert_array_equal(train[4]["tokens"], train.datasets[1][1]["tokens"])
    described = json.loads(train.description)
    assert described["size"] == 10 and described["weights"] == pytest.approx([9 / 13, 4 / 13])
    assert [m["dataset_path"] for m in described["datasets"]] == [a, b]


def test_unweighted_valid_blend_is_one_pass_when_more_is_asked(two):
    a, b = two
    cfg = config(train_data_path=[a], valid_data_path=[a, b], test_data_path=[b, a])
    train, valid, test = build_gpt_datasets(cfg, TOKENIZER, (5, 20, None))
    assert isinstance(train, GPTDataset) and train.num_samples == 5
    assert len(valid) == 13  # min(20, 9 + 4): validation cycles over it
    assert np.bincount(np.asarray(valid.dataset_index)).tolist() == [9, 4]
    # No sample count: the exhaustive blend, Megatron's size None and weights the lengths.
    assert len(test) == 13 and np.bincount(np.asarray(test.dataset_index)).tolist() == [4, 9]
    described = json.loads(test.description)
    assert described["size"] is None and described["weights"] == [4, 9]


def test_unweighted_train_blend_shorter_than_the_request_is_an_error(two):
    a, b = two
    with pytest.raises(GigatronError, match="read once, 13 training samples in all, but 20"):
        build_gpt_datasets(config(data_path=[a, b], split="1,0,0"), TOKENIZER, (20, 0, 0))


def test_weighted_blend_holds_the_sum_of_the_rounded_up_shares(two):
    a, b = two
    cfg = config(data_path=["1", a, "3", b], split="1,0,0")
    train = build_gpt_datasets(cfg, TOKENIZER, (10, 0, 0))[0]
    # shares 10 * 0.25 = 2.5 -> 3 and 10 * 0.75 = 7.5 -> 8: 11 samples; members are asked
    # ceil(3 * 1.005) = 4 and ceil(8 * 1.005) = 9.
    assert len(train) == 11
    assert [m.num_samples for m in train.datasets] == [4, 9]
    assert np.bincount(np.asarray(train.dataset_index)).tolist() == [3, 8]


def test_one_weighted_prefix(two):
    a, _ = two
    cfg = config(data_path=["1.0", a], split="1,0,0")
    train = build_gpt_datasets(cfg, TOKENIZER, (100, 0, 0))[0]
    # --data-path with a weight is a blend of one: the member gets the surplus,
    # ceil(100 * 1.005) = 101, and the blend passes its samples through in order.
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert train.datasets[0].num_samples == 101
    np.testing.assert_array_equal(np.asarray(train.dataset_sample_index), np.arange(100))
    # A per-split path of one prefix is a plain dataset; its weight is ignored (as Megatron).
    plain = build_gpt_datasets(config(train_data_path=["1.0", a]), TOKENIZER, (100, None, None))
    assert isinstance(plain[0], GPTDataset) and plain[0].num_samples == 100


# ----------------------------------------------------------------------------------------------
# A dataset class written here: one sample per document (the interface is the builder's only)


@dataclass
class DocumentOptions:
    split: str | None = None
    split_matrix: list = field(default_factory=list)


class DocumentDataset:
    cache_name = "DocumentDataset"

    def __init__(self, low_level, path, indices, num_samples, index_split, options, cache_dir):
        self.dataset, self.path, self.indices = low_level, path, indices
        self.num_samples, self.index_split = num_samples, index_split
        self.unique_identifiers = {"class": "DocumentDataset", "dataset_path": path}

    @staticmethod
    def options_from_config(cfg, tokenizer):
        return DocumentOptions()

    @staticmethod
    def numel_low_level_dataset(low_level):
        return len(low_level.document_indices) - 1

    @staticmethod
    def holds_data(low_level, indices):
        return len(indices) > 0

    @staticmethod
    def build_mock_low_level(cfg, tokenizer):
        raise GigatronError("no mock data")

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, index):
        return {"document": np.int64(self.indices[index])}


def test_a_dataset_class_of_its_own(two, tmp_path):
    a, b = two
    cfg = config(data_path=[a, b], split="6,2,2", data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_datasets(DocumentDataset, cfg, TOKENIZER, (10, 3, None))
    # --split 6,2,2 of 20 documents: [0, 12), [12, 16), [16, 20); of 10: [0, 6), [6, 8), [8, 10)
    assert [m.indices.tolist() for m in valid.datasets] == [[12, 13, 14, 15], [6, 7]]
    assert [m.indices.tolist() for m in test.datasets] == [[16, 17, 18, 19], [8, 9]]
    assert len(train) == 10 and len(valid) == 3  # min(10, 12 + 6), min(3, 4 + 2)
    assert len(test) == 6  # no count: every document once
    assert sorted(int(test[k]["document"]) for k in range(6)) == [8, 9, 16, 17, 18, 19]
    with pytest.raises(GigatronError, match="18 training samples in all, but 30"):
        build_datasets(DocumentDataset, cfg, TOKENIZER, (30, 3, None))


class FakeRanks:
    def __init__(self, rank):
        self.rank, self.world_size, self.barriers = rank, 2, 0

    def barrier(self):
        self.barriers += 1


def test_rank_zero_failure_releases_the_other_ranks(tmp_path):
    cfg = config(data_path=[str(tmp_path / "missing")], split="1,0,0")
    zero = FakeRanks(0)
    with pytest.raises(GigatronError, match="not found"):
        build_gpt_datasets(cfg, TOKENIZER, (5, 0, 0), zero)
    assert zero.barriers == 1  # the others are not left waiting at the barrier


def test_index_cache_entry(tmp_path):
    description = describe({"class": "X", "num_samples": 3})
    cache = IndexCache(str(tmp_path / "c"), "X-train", description)
    assert cache.hash == hashlib.md5(description.encode()).hexdigest()
    assert cache.load(["a.npy"]) is None
    cache.save({"a.npy": np.arange(4)})
    assert sorted(os.listdir(tmp_path / "c")) == [
        f"{cache.hash}-X-train-a.npy",
        f"{cache.hash}-X-train-description.txt",
    ]
    (loaded,) = cache.load(["a.npy"])
    assert isinstance(loaded, np.memmap) and loaded.tolist() == [0, 1, 2, 3]
    # Without the description (an interrupted write) the entry does not count.
    os.remove(cache.path("description.txt"))
    assert cache.load(["a.npy"]) is None
    assert IndexCache(None, "X-train", description).load(["a.npy"]) is None
