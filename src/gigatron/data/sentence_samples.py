"""Samples of consecutive sentences of one document (BERT), with Megatron-Core's sample index.

Megatron-Core builds BERT samples with a compiled helper (`build_mapping` in helpers.cpp); this
module computes the same rows with numpy and a loop over samples (not over sentences):

- a document is used when it has at least `min_sentences` sentences and, if it has more than one,
  none longer than 512 tokens;
- walking its sentences, a sample ends at the first sentence where (the sample holds at least
  `target` tokens, at least two sentences of the document remain, and the sample holds at least
  `min_sentences` sentences), or at the document's last sentence;
- `target` is drawn when a document starts and after every sample from a `std::mt19937(seed)`
  stream: with short_seq_ratio = round(1 / short_seq_prob), a draw r gives
  `2 + r % (max_length - 1)` when `r % ratio == 0`, else `max_length` (no draw when the
  probability is 0);
- epochs are walked until at least `num_samples` samples exist (one epoch when None); the rows
  (first sentence, end sentence, target length) are then shuffled by Fisher-Yates with a
  `std::mt19937_64(seed + 1)` stream: for i = n-1 .. 1, swap rows i and `r % (i + 1)`.

numpy's legacy RandomState is the same Mersenne Twister as std::mt19937 (same seeding, same
32-bit outputs); the 64-bit variant is implemented here.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

import numpy as np

from gigatron.errors import GigatronError

LONG_SENTENCE_LENGTH = 512
_UINT32_MAX = np.iinfo(np.uint32).max


class MT19937_64:
    """The 64-bit Mersenne Twister (C++ `std::mt19937_64`), seeded with one integer."""

    N, M = 312, 156
    MATRIX_A = np.uint64(0xB5026F5AA96619E9)
    UPPER = np.uint64(0xFFFFFFFF80000000)
    LOWER = np.uint64(0x7FFFFFFF)

    def __init__(self, seed: int) -> None:
        state = [int(seed) & 0xFFFFFFFFFFFFFFFF]
        for i in range(1, self.N):
            previous = state[-1]
            state.append((6364136223846793005 * (previous ^ (previous >> 62)) + i) & (2**64 - 1))
        self.state = np.array(state, dtype=np.uint64)
        self.position = self.N

    def _mix(self, upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
        x = (upper & self.UPPER) | (lower & self.LOWER)
        return (x >> np.uint64(1)) ^ ((x & np.uint64(1)) * self.MATRIX_A)

    def _twist(self) -> None:
        s, n, m = self.state, self.N, self.M
        # Entries [0, n-m) read only entries not yet rewritten; [n-m, n-1) read ones rewritten
        # by the first step (n = 2m); the last one reads the new entry 0.
        s[: n - m] = s[m:] ^ self._mix(s[: n - m], s[1 : n - m + 1])
        s[n - m : n - 1] = s[: m - 1] ^ self._mix(s[n - m : n - 1], s[n - m + 1 :])
        s[n - 1 :] = s[m - 1 : m] ^ self._mix(s[n - 1 :], s[:1])
        self.position = 0

    def random_raw(self, count: int) -> np.ndarray:
        """The next `count` outputs, uint64."""
        out = np.empty(count, dtype=np.uint64)
        filled = 0
        while filled < count:
            if self.position == self.N:
                self._twist()
            take = min(count - filled, self.N - self.position)
            out[filled : filled + take] = self.state[self.position : self.position + take]
            self.position += take
            filled += take
        y = out
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        return y


class _TargetLengths:
    """Target sample lengths drawn from a std::mt19937(seed) stream, computed in blocks."""

    def __init__(self, seed: int, max_length: int, short_seq_prob: float) -> None:
        self.max_length = max_length
        # C++ round(): halves away from zero.
        self.ratio = int(np.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
        self.random = np.random.RandomState(seed % 2**32)
        self.pending: list[int] = []  # drawn, not yet used
        self.used = 0

    def block(self, size: int = 1 << 16) -> list[int]:
        """The next `size` targets (the caller records how many it used in `self.used`)."""
        if self.ratio == 0:
            return [self.max_length] * size
        raw = self.random.randint(0, 2**32, size=size, dtype=np.uint32).astype(np.int64)
        short = raw % self.ratio == 0
        return np.where(short, 2 + raw % (self.max_length - 1), self.max_length).tolist()


def build_sentence_sample_index(
    document_bounds: np.ndarray,
    sentence_lengths: np.ndarray,
    num_samples: int | None,
    max_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> np.ndarray:
    """Rows (first sentence, end sentence, target length), shuffled; shape [n, 3].

    `document_bounds[d]` is the first sentence of document d (and the last entry the end of the
    last document): the documents of one split, contiguous. Raises GigatronError when no
    document can give a sample.
    """
    bounds = np.asarray(document_bounds, dtype=np.int64)
    lengths = np.asarray(sentence_lengths)
    if max_length < 2:
        raise ValueError(f"max_length {max_length}: a sample needs at least 2 tokens")
    first, last = bounds[:-1], bounds[1:]
    counts = last - first
    # Token prefix sums over the split's sentences, indexed by absolute sentence id - offset.
    offset = int(bounds[0]) if len(bounds) else 0
    span = lengths[offset : int(bounds[-1])] if len(bounds) else lengths[:0]
    cumulative = np.concatenate(([0], np.cumsum(span, dtype=np.int64)))
    long_count = np.concatenate(([0], np.cumsum(span > LONG_SENTENCE_LENGTH)))
    has_long = (long_count[last - offset] - long_count[first - offset]) > 0
    usable = (counts >= min_sentences) & ~((counts > 1) & has_long)
    starts, ends = first[usable] - offset, last[usable] - offset
    dtype = np.uint32 if len(lengths) <= _UINT32_MAX else np.uint64
    if num_samples == 0:
        return np.zeros((0, 3), dtype=dtype)
    if len(starts) == 0:
        raise GigatronError(
            f"no document has {min_sentences} or more sentences of at most "
            f"{LONG_SENTENCE_LENGTH} tokens, so no sample can be formed"
        )

    targets = _TargetLengths(seed, max_length, short_seq_prob)
    rows = array("q")  # (start, end, target) triples, 8 bytes each
    # Megatron checks the sample count only between epochs, so whole epochs are built.
    while not rows or (num_samples is not None and len(rows) // 3 < num_samples):
        for lo in range(0, len(starts), _DOCUMENTS_PER_BLOCK):
            block = slice(lo, lo + _DOCUMENTS_PER_BLOCK)
            _walk_documents(starts[block], ends[block], cumulative, targets, min_sentences, rows)
        if num_samples is None:
            break
    index = np.frombuffer(rows, dtype=np.int64).reshape(-1, 3).copy()
    index[:, :2] += offset
    return _shuffle_rows(index, seed + 1).astype(dtype)


_DOCUMENTS_PER_BLOCK = 1 << 16


def _walk_documents(
    starts: np.ndarray,
    ends: np.ndarray,
    cumulative: np.ndarray,
    targets: _TargetLengths,
    min_sentences: int,
    rows: array,
) -> None:
    """Append the samples of documents [starts, ends) (relative sentence ids) to `rows`."""
    base = int(starts[0])
    prefix = cumulative[base : int(ends[-1]) + 1].tolist()  # a Python list: bisect is fast
    pending, used = targets.pending, targets.used
    append = rows.extend
    for doc_start, doc_end in zip((starts - base).tolist(), (ends - base).tolist()):
        if used == len(pending):
            pending, used = targets.block(), 0
        target = pending[used]
        used += 1
        start = doc_start
        while start < doc_end:
            # First sentence t where the sample [start, t] reaches the target and holds enough
            # sentences; it must leave at least two sentences, else the document's end closes it.
            reach = bisect_left(prefix, prefix[start] + target, start + 1, doc_end + 1) - 1
            stop = max(reach, start + min_sentences - 1)
            if stop > doc_end - 3:
                stop = doc_end - 1
            append((start + base, stop + 1 + base, target))
            start = stop + 1
            if used == len(pending):
                pending, used = targets.block(), 0
            target = pending[used]
            used += 1
    targets.pending, targets.used = pending, used


def _shuffle_rows(index: np.ndarray, seed: int) -> np.ndarray:
    """Rows in std::mt19937_64(seed) Fisher-Yates order (swap i with r % (i + 1), i = n-1 .. 1)."""
    n = len(index)
    if n < 2:
        return index
    generator = MT19937_64(seed)
    order = array("q", range(n))
    block = 1 << 20
    for high in range(n - 1, 0, -block):  # i from n-1 down to 1, a block of draws at a time
        steps = min(block, high)
        bounds = np.arange(high + 1, high + 1 - steps, -1, dtype=np.uint64)  # i + 1
        partners = (generator.random_raw(steps) % bounds).tolist()
        for i, j in zip(range(high, high - steps, -1), partners):
            order[i], order[j] = order[j], order[i]
    return index[np.frombuffer(order, dtype=np.int64)]
