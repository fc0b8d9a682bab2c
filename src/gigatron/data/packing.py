"""Sequence packing: several documents in one training sequence, none seeing another.

Documents (token arrays, each with a per-token target flag) are placed into sequences of
`seq_length` positions by first-fit-decreasing (`first_fit_decreasing`): the longest first, each
into the first sequence with room. In a packed sequence (`packed_sample`) each document keeps the
positions it would have alone: its inputs are its tokens, its labels the next token of the same
document (the last position's label is never a target), its position ids start at 0, and the
attention mask (`document_attention_mask`, True = hidden) is causal inside the document and hides
every other document. So the loss sum and the gradients of a packed batch are those of the same
documents trained one per sequence; with a per-token loss (`--calculate-per-token-loss`) so is the
loss. Positions after the last document are padding: a segment of their own, never a target.
Under context parallelism each document is padded to a multiple of 2 cp positions (`multiple`;
the padding follows its document, never a target nor seen by it), so that the split per
document (parallel/context_parallel.py) cuts every document into 2 cp equal chunks; the sample's
`document_start` tells that split where the documents are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of document indices whose lengths (each cut to `capacity`) sum to at most
    `capacity`: longest first (ties by index), each into the first bin with room. The bins are in
    the order they were opened; each lists its documents in the order they were placed."""
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], capacity), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        size = min(lengths[index], capacity)
        # A linear scan is enough: a split holds thousands of conversations, not millions.
        place = next((b for b, free in enumerate(room) if free >= size), None)
        if place is None:
            bins.append([index])
            room.append(capacity - size)
        else:
            bins[place].append(index)
            room[place] -= size
    return bins


@dataclass(frozen=True)
class PackingStats:
    """How full the packed sequences are: tokens held / positions offered."""

    documents: int
    sequences: int
    tokens: int
    seq_length: int

    @property
    def fill_ratio(self) -> float:
        return self.tokens / max(self.sequences * self.seq_length, 1)

    def line(self, split: str) -> str:
        return (
            f"sequence packing ({split}): {self.documents} documents in {self.sequences} "
            f"sequences of {self.seq_length} tokens, fill ratio {100 * self.fill_ratio:.1f}% "
            f"(one per sequence: {100 * self.tokens / max(self.documents * self.seq_length, 1):.1f}%)"
        )


def packing_stats(lengths: Sequence[int], bins: list[list[int]], seq_length: int) -> PackingStats:
    tokens = sum(min(lengths[i], seq_length) for b in bins for i in b)
    return PackingStats(len(lengths), len(bins), tokens, seq_length)


def document_attention_mask(segment_start: np.ndarray) -> np.ndarray:
    """[1, s, s] bool, True = hidden: causal, and no query sees a key before the start of its
    own document (`segment_start[i]`: the first position of position i's document)."""
    positions = np.arange(len(segment_start))
    keys = positions[None, :]
    allowed = (keys <= positions[:, None]) & (keys >= segment_start[:, None])
    return ~allowed[None]


def padded_length(length: int, seq_length: int, multiple: int = 1) -> int:
    """The positions a document of `length` tokens takes: cut to seq_length, rounded up to a
    multiple of `multiple` (seq_length is one)."""
    used = min(length, seq_length)
    return min(-(-used // multiple) * multiple, seq_length)


def packed_sample(
    documents: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_length: int,
    pad: int,
    multiple: int = 1,
) -> dict[str, np.ndarray]:
    """One sequence of `seq_length` positions holding `documents` ((tokens, is_target) pairs,
    whose `padded_length`s sum to at most seq_length): tokens, labels, loss_mask, position_ids
    restarting per document, the attention mask that keeps each document to itself, and
    document_start (the first position of each position's document). A document of n tokens
    takes min(n, seq_length) positions, as it would alone, then padding to `multiple`."""
    tokens = np.full(seq_length, pad, dtype=np.int64)
    labels = np.full(seq_length, pad, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    positions = np.zeros(seq_length, dtype=np.int64)
    segment_start = np.zeros(seq_length, dtype=np.int64)
    start = 0
    for doc_tokens, targets in documents:
        used = min(len(doc_tokens), seq_length)
        end = start + padded_length(used, seq_length, multiple)
        if end > seq_length:
            raise ValueError(f"documents of {end} tokens do not fit {seq_length} positions")
        following = doc_tokens[1 : used + 1]
        tokens[start : start + used] = doc_tokens[:used]
        labels[start : start + len(following)] = following
        loss_mask[start : start + len(following)] = targets[1 : used + 1]
        positions[start:end] = np.arange(end - start)
        segment_start[start:end] = start
        start = end
    positions[start:] = np.arange(seq_length - start)  # padding: one segment of its own
    segment_start[start:] = start
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": positions,
        "attention_mask": document_attention_mask(segment_start),
        "document_start": segment_start,
    }
