"""Index builders of the GPT dataset: document order, sample boundaries, sample order.

These reproduce Megatron-Core's GPTDataset indices exactly (same seed -> same arrays), but the
sample index is computed with numpy (a cumulative sum and a binary search) instead of a compiled
C++ helper, so nothing is built at run time.
"""

from __future__ import annotations

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max
_UINT32_MAX = np.iinfo(np.uint32).max


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_length + 1."""
    if num_samples is None:
        return 1
    tokens_needed = num_samples * seq_length + 1
    return max(1, -(-tokens_needed // tokens_per_epoch))


def use_separate_final_epoch(
    tokens_per_epoch: int, seq_length: int, num_samples: int | None, num_epochs: int
) -> tuple[bool, int]:
    """Whether the last epoch is shuffled on its own, and the sample count before it.

    The last epoch is kept apart when fewer than 80% of its samples are needed, so that the
    samples drawn from it are not concentrated at random places of the whole set.
    """
    if num_epochs == 1 or num_samples is None:
        return False, 0
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_from_final = num_samples - samples_before_final
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return samples_from_final < int(0.80 * samples_per_epoch), samples_before_final


def build_document_index(
    indices: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """The split's document ids repeated `num_epochs` times (epoch-major), shuffled, int32."""
    indices = np.asarray(indices)
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(indices, num_epochs).astype(np.int32)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(indices, num_epochs - 1, rng, False)
    last = build_document_index(indices, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool = True,
) -> np.ndarray:
    """Rows (position in document_index, token offset) where each sample starts; shape [M+1, 2].

    A sample spans seq_length + 1 tokens of the documents concatenated in document_index order,
    and the next sample starts on the last token of the previous one, so sample k starts at
    global token k * seq_length. Row M marks where the last sample ends (its last token).
    """
    total_tokens = num_epochs * tokens_per_epoch
    if drop_last_partial:
        num_samples = (total_tokens - 1) // seq_length
    else:
        num_samples = -(-(total_tokens - 1) // seq_length)
    lengths = np.asarray(sequence_lengths)[np.asarray(document_index)].astype(np.int64)
    document_ends = np.cumsum(lengths)
    if document_ends.size == 0 or document_ends[-1] != total_tokens:
        raise ValueError(
            f"documents hold {int(document_ends[-1]) if document_ends.size else 0} tokens, "
            f"expected num_epochs * tokens_per_epoch = {total_tokens}"
        )
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # A partial last sample (kept only when asked) ends on the very last token.
    np.minimum(starts, total_tokens - 1, out=starts)
    # The document holding global token p is the first whose end lies beyond p (skips empty ones).
    position = np.searchsorted(document_ends, starts, side="right")
    offset = starts - (document_ends[position] - lengths[position])
    largest = max(len(document_index), int(np.max(sequence_lengths, initial=0)))
    dtype = np.int32 if largest <= _INT32_MAX else np.int64
    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[:, 0] = position
    sample_index[:, 1] = offset
    sample_index[0] = (0, 0)
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """arange(total_size) with [0, num_samples) and [num_samples, total_size) shuffled apart."""
    dtype = np.uint32 if total_size < _UINT32_MAX - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_all_indices(
    sequence_lengths: np.ndarray,
    indices: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    drop_last_partial: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """document_index, sample_index, shuffle_index of one split, drawn from RandomState(seed)."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[np.asarray(indices)].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate, samples_before_final = use_separate_final_epoch(
        tokens_per_epoch, seq_length, num_samples, num_epochs
    )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(indices, num_epochs, rng, separate)
    sample_index = build_sample_index(
        sequence_lengths,
        document_index,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial,
    )
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(samples_before_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index
