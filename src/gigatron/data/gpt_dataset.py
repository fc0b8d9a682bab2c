"""GPT pre-training samples from .bin/.idx datasets, with Megatron-Core's indices and cache.

A sample is seq_length + 1 consecutive tokens of the split's documents, concatenated in a
shuffled order (several epochs when more samples are asked than one epoch holds); tokens are its
first seq_length tokens, labels its last seq_length. Given the same data, split, seed and sequence
length, the samples and their order are the ones Megatron-Core's GPTDataset produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gigatron.data import builder
from gigatron.data.builder import (  # noqa: F401  (the split/blend parsers, importable from here)
    DEFAULT_SPLIT,
    MOCK_SPLIT,
    SPLIT_NAMES,
    Bookend,
    parse_blend,
    parse_split,
    split_indices,
    split_matrix,
)
from gigatron.data.index_cache import IndexCache
from gigatron.data.indexed import DocumentTable
from gigatron.data.packing import document_attention_mask
from gigatron.data.sample_index import build_all_indices
from gigatron.errors import GigatronError

PAD_WHEN_NO_PAD_TOKEN = -1
INDEX_NAMES = ("document_index.npy", "sample_index.npy", "shuffle_index.npy")


# ----------------------------------------------------------------------------------------------
# Synthetic documents for --mock-data


class MockTokenDataset(DocumentTable):
    """Documents of seeded random lengths whose tokens are computed, not read (--mock-data).

    Serves the part of IndexedDataset's interface that GPTDataset uses.
    """

    def __init__(
        self, vocab_size: int, eod: int, num_documents: int = 10_000, max_length: int = 4096
    ) -> None:
        self.path = None
        self.vocab_size = max(int(vocab_size), 2)
        self.eod = int(eod)
        self._sequence_lengths = (
            np.random.RandomState(0).randint(1, max_length, size=num_documents).astype(np.int32)
        )
        self._document_indices = np.arange(num_documents + 1, dtype=np.int64)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self._sequence_lengths[index])
        if length is None:
            length = size - offset
        position = np.arange(offset, offset + length, dtype=np.int64)
        # Ordinary tokens skip the eod id; the document's last token is eod.
        tokens = (position * 7 + index) % (self.vocab_size - 1)
        tokens += tokens >= self.eod
        tokens[position == size - 1] = self.eod
        return tokens


# ----------------------------------------------------------------------------------------------
# The dataset


@dataclass
class GPTDatasetOptions:
    """Everything a GPTDataset needs besides its documents."""

    seq_length: int
    seed: int = 1234
    split: str | None = None
    split_matrix: list[Bookend] = field(default_factory=list)
    eod: int | None = None
    pad: int | None = None
    tokenizer_identifiers: dict[str, Any] = field(default_factory=dict)
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # --no-create-attention-mask-in-dataloader: never build a mask here (the model's causal mask
    # is used). gigatron builds one only when --reset-attention-mask needs it, which validation
    # does not allow together with this.
    create_attention_mask: bool = True

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> GPTDatasetOptions:
        identifiers = getattr(tokenizer, "unique_identifiers", {})
        if callable(identifiers):
            identifiers = identifiers()
        return cls(
            eod=getattr(tokenizer, "eod", None),
            pad=getattr(tokenizer, "pad", None),
            tokenizer_identifiers=dict(identifiers),
            **kwargs,
        )


class GPTDataset(builder.SplitDataset):
    """One split of one low-level dataset, as `len(self)` samples of seq_length tokens.

    `len()` is the whole set of epochs built (at least `num_samples`), as in Megatron-Core.
    Indices are cached under `cache_dir` (None: not cached) keyed by an MD5 of `description`.
    Built for a configuration by `build_gpt_datasets` (the generic `data.builder`).
    """

    cache_name = "GPTDataset"

    def build_indices(self, where: str, cache_dir: str | None) -> None:
        options, low_level, indices = self.options, self.dataset, self.indices
        self.pad_id = options.pad if options.pad is not None else PAD_WHEN_NO_PAD_TOKEN
        tokens = int(np.asarray(low_level.sequence_lengths)[indices].sum(dtype=np.int64))
        if tokens == 0:
            raise GigatronError(
                f"--split {options.split}: {where} holds no tokens ({len(indices)} of "
                f"{len(low_level)} sequences) but samples are asked of it; change "
                f"--split to give {self.index_split} a larger share, or give "
                f"--{self.index_split}-data-path"
            )
        self.unique_identifiers = self.identifiers("GPTDataset")
        loaded = self.load_indices(
            cache_dir,
            f"GPTDataset-{self.index_split}",
            INDEX_NAMES,
            lambda: build_all_indices(
                low_level.sequence_lengths, indices, self.seq_length, self.num_samples, options.seed
            ),
        )
        self.document_index, self.sample_index, self.shuffle_index = loaded

    # The interface of data.builder.
    @staticmethod
    def options_from_config(cfg: Any, tokenizer: Any) -> GPTDatasetOptions:
        data = cfg.data
        if cfg.model.seq_length is None:
            raise GigatronError("--seq-length is required to build GPT datasets")
        return GPTDatasetOptions.from_tokenizer(
            tokenizer,
            seq_length=int(cfg.model.seq_length),
            seed=int(cfg.training.seed),
            eod_mask_loss=bool(data.eod_mask_loss),
            reset_position_ids=bool(data.reset_position_ids),
            reset_attention_mask=bool(data.reset_attention_mask),
            create_attention_mask=bool(data.create_attention_mask_in_dataloader),
        )

    @staticmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        """--split divides the sequences (documents, or sentences when they were split)."""
        return len(low_level)

    @staticmethod
    def holds_data(low_level: Any, indices: np.ndarray) -> bool:
        return bool(np.asarray(low_level.sequence_lengths)[indices].any())

    @staticmethod
    def build_mock_low_level(cfg: Any, tokenizer: Any) -> MockTokenDataset:
        eod = getattr(tokenizer, "eod", None)
        vocab = getattr(tokenizer, "vocab_size", None) or ((eod or 0) + 1)
        return MockTokenDataset(vocab, eod if eod is not None else vocab - 1)

    def cache_files(self, cache_dir: str) -> dict[str, str]:
        """The description and index files of this dataset in `cache_dir`."""
        return IndexCache(cache_dir, f"GPTDataset-{self.index_split}", self.description).files(
            INDEX_NAMES
        )

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def text(self, index: int) -> tuple[np.ndarray, int]:
        """The seq_length + 1 tokens of sample `index` (int64, padded) and how many are real."""
        j = int(self.shuffle_index[index])
        first, first_offset = (int(x) for x in self.sample_index[j])
        last, last_offset = (int(x) for x in self.sample_index[j + 1])
        doc = self.document_index
        get = self.dataset.get
        if first == last:
            parts = [get(int(doc[first]), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(int(doc[first]), first_offset)]
            parts += [get(int(doc[p])) for p in range(first + 1, last)]
            parts.append(get(int(doc[last]), 0, last_offset + 1))
        text = np.concatenate(parts).astype(np.int64)
        real = len(text)
        if real < self.seq_length + 1:
            text = np.concatenate(
                [text, np.full(self.seq_length + 1 - real, self.pad_id, dtype=np.int64)]
            )
        return text, real

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        text, real = self.text(self.position(index))
        return make_sample(text, real, self.options)


def make_sample(text: np.ndarray, real: int, options: GPTDatasetOptions) -> dict[str, np.ndarray]:
    """tokens, labels, loss_mask, position_ids (and attention_mask) from S + 1 tokens."""
    seq = len(text) - 1
    tokens = text[:-1].copy()
    labels = text[1:].copy()
    loss_mask = np.ones(seq, dtype=np.float32)
    positions = np.arange(seq, dtype=np.int64)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
    needs_eod = options.eod_mask_loss or options.reset_position_ids or options.reset_attention_mask
    if needs_eod and options.eod is not None:
        is_eod = tokens == options.eod
        if options.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        # Start of the document each position belongs to (documents end at an eod token).
        segment_start = np.zeros(seq, dtype=np.int64)
        after_eod = np.flatnonzero(is_eod) + 1
        after_eod = after_eod[after_eod < seq]
        segment_start[after_eod] = after_eod
        segment_start = np.maximum.accumulate(segment_start)
        if options.reset_position_ids:
            sample["position_ids"] = positions - segment_start
        if options.reset_attention_mask and options.create_attention_mask:
            sample["attention_mask"] = document_attention_mask(segment_start)
    elif options.reset_attention_mask and options.create_attention_mask:
        sample["attention_mask"] = ~np.tri(seq, dtype=bool)[None]
    # Padding is masked by position, not by value, so a pad id that also occurs in the text
    # (a pad equal to eod, say) keeps its loss.
    if real < seq + 1:
        loss_mask[max(real - 1, 0) :] = 0.0
        tokens[real:] = 0
        labels[max(real - 1, 0) :] = 0
    return sample


# ----------------------------------------------------------------------------------------------
# Building the three splits from the configuration


def default_cache_dir(prefix: str) -> str:
    return builder.default_cache_dir(prefix, GPTDataset.cache_name)


# (train, valid, test) GPT datasets of a configuration; None for a split that is absent.
# With a ParallelContext of several ranks, rank 0 builds (and caches) the indices first and the
# others then load them, so the work is not repeated on every rank.
build_gpt_datasets = GPTDataset.build_splits
