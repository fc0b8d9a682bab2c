"""The numpy index builders against a plain-Python walk of Megatron's sample-index algorithm."""

from __future__ import annotations

import numpy as np
import pytest

from gigatron.data.sample_index import (
    build_all_indices,
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    num_epochs_needed,
    use_separate_final_epoch,
)


def reference_sample_index(
    lengths, document_index, seq_length, num_epochs, tokens_per_epoch, drop_last_partial=True
):
    """Token-by-token walk: each sample takes seq_length + 1 tokens, the next starts on the last."""
    total = num_epochs * tokens_per_epoch
    if drop_last_partial:
        num_samples = (total - 1) // seq_length
    else:
        num_samples = -(-(total - 1) // seq_length)
    rows = [(0, 0)]
    position, offset = 0, 0
    for sample in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            available = int(lengths[document_index[position]]) - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                if position == len(document_index) - 1:
                    assert sample == num_samples
                    offset = int(lengths[document_index[position]]) - 1
                    break
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows)


def random_case(rng, num_docs, max_len, seq_length):
    lengths = rng.randint(1, max_len + 1, size=num_docs).astype(np.int32)
    lengths[rng.randint(num_docs)] = 1  # a single-token document
    lengths[rng.randint(num_docs)] = 5 * seq_length + 3  # one spanning several samples
    return lengths


@pytest.mark.parametrize("case", range(40))
def test_sample_index_matches_reference_walk(case):
    rng = np.random.RandomState(case)
    seq_length = int(rng.randint(1, 20))
    lengths = random_case(rng, int(rng.randint(1, 30)), int(rng.randint(1, 40)), seq_length)
    indices = np.arange(len(lengths))
    if len(lengths) > 3:
        indices = np.sort(rng.choice(len(lengths), size=len(lengths) - 2, replace=False))
    num_epochs = int(rng.randint(1, 4))
    tokens_per_epoch = int(lengths[indices].sum())
    document_index = build_document_index(indices, num_epochs, rng, bool(case % 2))
    for drop in (True, False):
        got = build_sample_index(
            lengths, document_index, seq_length, num_epochs, tokens_per_epoch, drop
        )
        want = reference_sample_index(
            lengths, document_index, seq_length, num_epochs, tokens_per_epoch, drop
        )
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32


def test_sample_index_with_empty_documents_in_the_middle():
    lengths = np.array([3, 0, 0, 4, 0, 2, 5], dtype=np.int32)
    document_index = np.arange(7, dtype=np.int32)
    for seq_length in (1, 2, 3, 4):
        got = build_sample_index(lengths, document_index, seq_length, 1, 14)
        want = reference_sample_index(lengths, document_index, seq_length, 1, 14)
        np.testing.assert_array_equal(got, want)


def test_hand_computed_sample_index():
    # documents [a a a] [b b] [c c c c], seq 2: samples take 3 tokens, overlapping by one.
    lengths = np.array([3, 2, 4], dtype=np.int32)
    got = build_sample_index(lengths, np.array([0, 1, 2], dtype=np.int32), 2, 1, 9)
    # global starts 0, 2, 4, 6 -> (doc 0, 0), (doc 0, 2), (doc 1, 1), (doc 2, 1); M = 8 // 2 = 4
    # sample 3 = tokens 6..8 and row 4 marks its end at global 8 = (doc 2, 3).
    np.testing.assert_array_equal(got, [[0, 0], [0, 2], [1, 1], [2, 1], [2, 3]])


def test_epochs_and_separate_final_epoch():
    assert num_epochs_needed(100, 10, None) == 1
    assert num_epochs_needed(100, 10, 9) == 1  # 91 tokens
    assert num_epochs_needed(100, 10, 10) == 2  # 101 tokens
    assert num_epochs_needed(100, 10, 25) == 3
    # 3 epochs of 100 tokens at seq 10: 19 samples before the last epoch, 9 per epoch.
    assert use_separate_final_epoch(100, 10, 25, 3) == (True, 19)  # 6 < int(0.8 * 9) = 7
    assert use_separate_final_epoch(100, 10, 27, 3) == (False, 19)  # 8 >= 7
    assert use_separate_final_epoch(100, 10, 5, 1) == (False, 0)


def test_document_index_is_megatron_order():
    # Megatron tiles the ids epoch-major as int32 and shuffles the whole array with one RNG.
    indices = np.arange(5, 12)
    rng = np.random.RandomState(1234)
    got = build_document_index(indices, 3, rng, False)
    expected = np.concatenate([indices] * 3).astype(np.int32)
    np.random.RandomState(1234).shuffle(expected)
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.int32
    separate = build_document_index(indices, 3, np.random.RandomState(7), True)
    # first two epochs mix among themselves, the last epoch is a permutation of one epoch
    assert sorted(separate[:14]) == sorted(list(indices) * 2)
    assert sorted(separate[14:]) == list(indices)


def test_shuffle_index_separate_parts():
    rng = np.random.RandomState(3)
    got = build_shuffle_index(6, 10, rng)
    assert got.dtype == np.uint32
    assert sorted(got[:6]) == list(range(6))
    assert sorted(got[6:]) == list(range(6, 10))
    want_first = np.arange(6, dtype=np.uint32)
    want_last = np.arange(6, 10, dtype=np.uint32)
    reference_rng = np.random.RandomState(3)
    reference_rng.shuffle(want_first)
    reference_rng.shuffle(want_last)
    np.testing.assert_array_equal(got, np.concatenate([want_first, want_last]))


def test_build_all_indices_covers_requested_samples():
    lengths = np.random.RandomState(0).randint(1, 50, size=40).astype(np.int32)
    indices = np.arange(10, 30)
    doc, sample, shuffle = build_all_indices(lengths, indices, 16, 100, seed=1234)
    tokens_per_epoch = int(lengths[indices].sum())
    epochs = num_epochs_needed(tokens_per_epoch, 16, 100)
    assert len(doc) == epochs * 20
    assert len(shuffle) == sample.shape[0] - 1 == (epochs * tokens_per_epoch - 1) // 16 >= 100
    assert sorted(shuffle.tolist()) == list(range(len(shuffle)))
    assert set(doc.tolist()) == set(indices.tolist())
