"""BERT sample boundaries: the Mersenne Twisters, and the numpy walk against a sentence-by-sentence
walk of Megatron-Core's rule."""

from __future__ import annotations

import numpy as np
import pytest

from gigatron.data.sentence_samples import MT19937_64, build_sentence_sample_index
from gigatron.errors import GigatronError


def test_mersenne_twisters_match_the_cpp_standard():
    # The C++ standard fixes the 10000th output of a default-seeded (5489) engine.
    assert int(MT19937_64(5489).random_raw(10000)[-1]) == 9981545732273789042
    # numpy's legacy RandomState is std::mt19937 (same seeding, same 32-bit outputs).
    raw = np.random.RandomState(5489).randint(0, 2**32, size=10000, dtype=np.uint32)
    assert int(raw[-1]) == 4123659995
    # Drawn in pieces or at once, the stream is the same.
    engine = MT19937_64(1235)
    pieces = np.concatenate([engine.random_raw(n) for n in (1, 311, 1, 400)])
    np.testing.assert_array_equal(pieces, MT19937_64(1235).random_raw(713))
    assert int(pieces[0]) == 12475983374653888083  # std::mt19937_64(1235)(), printed by g++


def reference_rows(bounds, lengths, num_samples, max_length, short_seq_prob, seed, min_sentences):
    """Sentence by sentence: the rule as Megatron-Core's helper states it, then the shuffle."""
    ratio = int(np.floor(1 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
    stream = np.random.RandomState(seed)

    def target():
        if ratio == 0:
            return max_length
        r = int(stream.randint(0, 2**32, dtype=np.uint32))
        return 2 + r % (max_length - 1) if r % ratio == 0 else max_length

    rows = []
    epochs = 1 if num_samples is None else 10**9
    for _ in range(epochs):
        if num_samples is not None and len(rows) >= num_samples:
            break
        before = len(rows)
        for first, last in zip(bounds[:-1], bounds[1:]):
            remaining = last - first
            long = remaining > 1 and any(lengths[s] > 512 for s in range(first, last))
            if remaining < min_sentences or long:
                continue
            tokens, count, start, goal = 0, 0, first, target()
            for s in range(first, last):
                tokens += lengths[s]
                count += 1
                remaining -= 1
                full = tokens >= goal and remaining > 1 and count >= min_sentences
                if full or remaining == 0:
                    rows.append((start, s + 1, goal))
                    start, tokens, count, goal = s + 1, 0, 0, target()
        if len(rows) == before:
            break  # no usable document: Megatron would loop for ever here
    engine = MT19937_64(seed + 1)
    for i in range(len(rows) - 1, 0, -1):
        j = int(engine.random_raw(1)[0] % np.uint64(i + 1))
        rows[i], rows[j] = rows[j], rows[i]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


@pytest.mark.parametrize("case", range(60))
def test_matches_the_sentence_by_sentence_walk(case):
    rng = np.random.RandomState(case)
    num_docs = int(rng.randint(1, 30))
    per_doc = rng.randint(0, 9, size=num_docs)
    lengths = rng.randint(1, 60, size=int(per_doc.sum())).astype(np.int32)
    if case % 5 == 0 and len(lengths):
        lengths[rng.randint(len(lengths))] = 600  # its document is left out
    all_bounds = np.concatenate(([0], np.cumsum(per_doc)))
    lo = int(rng.randint(0, num_docs))
    bounds = all_bounds[lo : int(rng.randint(lo + 1, num_docs + 1)) + 1]
    args = (
        [None, 1, 7, 60][case % 4],
        int(rng.choice([2, 5, 13, 61, 125])),
        float(rng.choice([0.0, 0.1, 0.4, 1.0])),
        int(rng.randint(1, 10_000)),
        1 + case % 2,
    )
    want = reference_rows(bounds.tolist(), lengths.tolist(), *args)
    if len(want) == 0:
        with pytest.raises(GigatronError, match="no document"):
            build_sentence_sample_index(bounds, lengths, *args)
        return
    got = build_sentence_sample_index(bounds, lengths, *args)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, want)


def test_hand_computed_rows():
    # One document of sentences of 3, 4, 5, 6 tokens; target 7, no short samples, 2 per sample:
    # [3, 4] reaches 7 with two sentences left -> (0, 2); [5, 6] ends the document -> (2, 4).
    rows = build_sentence_sample_index([0, 4], [3, 4, 5, 6], None, 7, 0.0, 1, 2)
    assert sorted(map(tuple, rows.tolist())) == [(0, 2, 7), (2, 4, 7)]
    # Target 3: [3] reaches it but one sentence is too few; [3, 4] -> (0, 2) as before.
    rows = build_sentence_sample_index([0, 4], [3, 4, 5, 6], None, 3, 0.0, 1, 2)
    assert sorted(map(tuple, rows.tolist())) == [(0, 2, 3), (2, 4, 3)]
    # With one sentence a sample: [3] -> (0, 1), [4] -> (1, 2); then only two remain: (2, 4).
    rows = build_sentence_sample_index([0, 4], [3, 4, 5, 6], None, 3, 0.0, 1, 1)
    assert sorted(map(tuple, rows.tolist())) == [(0, 1, 3), (1, 2, 3), (2, 4, 3)]


def test_epochs_are_whole_and_short_targets_follow_the_probability():
    bounds = np.arange(0, 401, 4)  # 100 documents of 4 sentences
    lengths = np.full(400, 10, dtype=np.int32)
    one_epoch = build_sentence_sample_index(bounds, lengths, None, 20, 0.0, 3, 2)
    assert len(one_epoch) == 200  # every document gives [2 sentences][2 sentences]
    several = build_sentence_sample_index(bounds, lengths, 450, 20, 0.0, 3, 2)
    assert len(several) == 600  # whole epochs until at least 450
    assert build_sentence_sample_index(bounds, lengths, 0, 20, 0.0, 3, 2).shape == (0, 3)
    # Ratio round(1 / 0.25) = 4: a quarter of the targets are 2 + r % 19 <= 20, most below.
    rows = build_sentence_sample_index(bounds, lengths, 20_000, 20, 0.25, 3, 1)
    short = np.mean(rows[:, 2] < 20)
    assert 0.2 < short < 0.26
    assert rows[:, 2].min() >= 2


def test_no_usable_document_is_an_error():
    with pytest.raises(GigatronError, match="2 or more sentences"):
        build_sentence_sample_index([0, 1, 2], [5, 5], 10, 20, 0.1, 1, 2)
