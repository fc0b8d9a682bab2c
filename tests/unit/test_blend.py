"""BlendedDataset: the greedy deficit rule, its proportions, sizes, errors and cache."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gigatron.data.blend import (
    BlendedDataset,
    build_blending_indices,
    member_sample_counts,
)
from gigatron.errors import GigatronError


def reference_blend(weights, size):
    """Megatron's rule, one sample at a time: largest w_d * max(i, 1) - count_d, ties lowest d."""
    counts = [0] * len(weights)
    dataset_index, sample_index = [], []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        best = max(range(len(weights)), key=lambda d: (errors[d], -d))
        dataset_index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return np.array(dataset_index), np.array(sample_index)


@pytest.mark.parametrize(
    "weights",
    [
        [1.0],
        [0.5, 0.5],
        [0.3, 0.7],
        [0.001, 0.999],
        [0.2, 0.3, 0.5],
        [0.1, 0.25, 0.05, 0.3, 0.3],
        list(np.random.RandomState(0).rand(12) / np.random.RandomState(0).rand(12).sum()),
        [0.0, 0.6, 0.4],
    ],
)
def test_matches_reference_rule(weights):
    size = 20000
    dataset_index, sample_index = build_blending_indices(weights, size)
    want_index, want_sample = reference_blend([float(w) for w in weights], size)
    np.testing.assert_array_equal(dataset_index, want_index)
    np.testing.assert_array_equal(sample_index, want_sample)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64


@pytest.mark.parametrize(
    "weights, bound",
    [([0.3, 0.7], 1.0), ([0.001, 0.999], 1.0), ([0.2, 0.3, 0.5], 2.0), ([0.05, 0.15, 0.8], 2.0)],
)
def test_proportions_close_at_every_prefix(weights, bound):
    # Megatron's rule keeps two datasets within one sample of their share at every prefix; with
    # more datasets a share can lag by up to about two samples (1.2 for the last case).
    size = 50000
    dataset_index, _ = build_blending_indices(weights, size)
    onehot = np.zeros((size, len(weights)))
    onehot[np.arange(size), dataset_index] = 1
    counts = np.cumsum(onehot, axis=0)
    expected = np.arange(1, size + 1)[:, None] * np.asarray(weights)[None, :]
    assert np.abs(counts - expected).max() <= bound


def test_large_two_way_blend_is_fast_and_exact_at_the_end():
    import time

    start = time.perf_counter()
    dataset_index, sample_index = build_blending_indices([0.37, 0.63], 2_000_000)
    elapsed = time.perf_counter() - start
    assert elapsed < 10  # the vectorised path; the plain loop needs several seconds
    counts = np.bincount(dataset_index)
    assert abs(counts[0] - 0.37 * 2_000_000) <= 1
    assert sample_index[dataset_index == 1][-1] == counts[1] - 1


def test_member_requests_with_surplus():
    assert member_sample_counts(1000, [0.3, 0.7], 0.005) == [302, 704]
    assert member_sample_counts(1, [0.5, 0.5], 0.0) == [1, 1]


class ListDataset:
    def __init__(self, name, size):
        self.path = name
        self.items = [{"tokens": np.array([name * 100 + i])} for i in range(size)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def test_items_and_determinism(tmp_path):
    members = [ListDataset(1, 40), ListDataset(2, 80)]
    blend = BlendedDataset(members, [1, 2], 90)
    again = BlendedDataset(members, [1, 2], 90)
    assert len(blend) == 90
    items = [blend[i] for i in range(90)]
    assert [int(x["dataset_id"]) for x in items] == [int(again[i]["dataset_id"]) for i in range(90)]
    firsts = [int(x["tokens"][0]) for x in items if int(x["dataset_id"]) == 0]
    assert firsts == [100 + i for i in range(30)]  # member samples read in order


def test_oversampling_is_a_clear_error():
    members = [ListDataset(1, 10), ListDataset(2, 100)]
    with pytest.raises(GigatronError, match="mid-level-dataset-surplus"):
        BlendedDataset(members, [0.5, 0.5], 40)


def test_cache_reuse(tmp_path):
    members = [ListDataset(1, 50), ListDataset(2, 50)]
    cache = str(tmp_path / "cache")
    first = BlendedDataset(members, [0.4, 0.6], 60, "train", cache)
    names = sorted(os.listdir(cache))
    assert len(names) == 3 and all("-BlendedDataset-train-" in n for n in names)
    second = BlendedDataset(members, [0.4, 0.6], 60, "train", cache)
    assert isinstance(second.dataset_index, np.memmap)
    np.testing.assert_array_equal(first.dataset_index, second.dataset_index)
    third = BlendedDataset(members, [0.5, 0.5], 60, "train", cache)
    assert third.unique_description_hash != first.unique_description_hash


def test_bad_weights():
    with pytest.raises(GigatronError, match="weights"):
        BlendedDataset([ListDataset(1, 5)], [-1.0], 3)
    with pytest.raises(GigatronError, match="one each"):
        BlendedDataset([ListDataset(1, 5)], [0.5, 0.5], 3)
