"""GPT pre-training samples from .bin/.idx datasets, with Megatron-Core's indices and cache.

A sample is seq_length + 1 consecutive tokens of the split's documents, concatenated in a
shuffled order (several epochs when more samples are asked than one epoch holds); tokens are its
first seq_length tokens, labels its last seq_length. Given the same data, split, seed and sequence
length, the samples and their order are the ones Megatron-Core's GPTDataset produces.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from gigatron.data.blend import BlendedDataset, member_sample_counts, normalize_weights
from gigatron.data.sample_index import build_all_indices
from gigatron.errors import GigatronError

SPLIT_NAMES = ("train", "valid", "test")
# What Megatron uses (and warns about) when --data-path comes without --split.
DEFAULT_SPLIT = "969, 30, 1"
MOCK_SPLIT = "1,1,1"
PAD_WHEN_NO_PAD_TOKEN = -1

Bookend = tuple[float, float] | None


# ----------------------------------------------------------------------------------------------
# --split and --data-path parsing


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> [0.969, 0.03, 0.001]: up to three numbers separated by ',' (or '/'),
    right-padded with 0 to three, normalised. Anything else is refused (Megatron-Core would
    read '90,x,10' as 90,10 and silently give the test share to validation)."""
    pieces = [piece.strip() for piece in re.split(r"[,/]", split)]
    values = []
    for piece in pieces:
        try:
            value = float(piece)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value < 0:
            raise GigatronError(
                f"--split {split!r}: {piece!r} is not a non-negative number; give up to three "
                "proportions separated by commas, e.g. --split 969,30,1"
            )
        values.append(value)
    if len(values) > 3 or sum(values) <= 0:
        raise GigatronError(
            f"--split {split!r}: give up to three non-negative proportions with a positive sum, "
            "e.g. --split 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [x / total for x in values]


def split_matrix(proportions: list[float]) -> list[Bookend]:
    """Bookends [(lo, hi)] of each split in [0, 1]; None for an empty split."""
    edges = [0, *accumulate(proportions)]
    return [(lo, hi) if hi - lo > 0 else None for lo, hi in zip(edges[:-1], edges[1:])]


def split_indices(num_elements: int, bookend: Bookend) -> np.ndarray | None:
    """Sequence ids [round(lo * N), round(hi * N)) of a split (contiguous, unshuffled)."""
    if bookend is None:
        return None
    lo, hi = bookend
    return np.arange(int(round(lo * num_elements)), int(round(hi * num_elements)), dtype=np.int32)


def parse_blend(values: list[str] | None, flag: str) -> tuple[list[str], list[float] | None]:
    """'p' | 'w1 p1 w2 p2 ...' | 'p1 p2 ...' -> (prefixes, weights or None)."""
    items = [piece for value in values or [] for piece in str(value).split()]
    if not items:
        raise GigatronError(f"{flag}: no dataset prefix given")
    if len(items) == 1:
        return items, None
    if len(items) % 2 == 0:
        try:
            weights = [float(items[i]) for i in range(0, len(items), 2)]
        except ValueError:
            weights = None
        if weights is not None:
            return [items[i] for i in range(1, len(items), 2)], weights
    if any(_is_number(item) for item in items):
        raise GigatronError(
            f"{flag} {' '.join(items)}: mixes numbers and paths; give 'weight prefix' pairs "
            "(e.g. 0.3 data/a_text_document 0.7 data/b_text_document) or prefixes only"
        )
    _check_no_bad_weight(items, flag)
    return items, None


def _check_no_bad_weight(items: list[str], flag: str) -> None:
    """Prefixes only, e.g. 'abc data/x': when every second item is a dataset but an item before
    one is not, that item was meant as a weight and is not a number."""
    from gigatron.data.indexed import dataset_exists

    if len(items) % 2:
        return
    weights, prefixes = items[0::2], items[1::2]
    if not all(dataset_exists(prefix) for prefix in prefixes):
        return
    for weight in weights:
        if not dataset_exists(weight):
            raise GigatronError(
                f"{flag} {' '.join(items)}: blend weight {weight!r} is not a number (nor a "
                "dataset prefix); give 'weight prefix' pairs with numeric weights, e.g. "
                "0.3 data/a_text_document 0.7 data/b_text_document"
            )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Synthetic documents for --mock-data


class MockTokenDataset:
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

    def __len__(self) -> int:
        return len(self._sequence_lengths)

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self._document_indices

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


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


class GPTDataset:
    """One split of one low-level dataset, as `len(self)` samples of seq_length tokens.

    `len()` is the whole set of epochs built (at least `num_samples`), as in Megatron-Core.
    Indices are cached under `cache_dir` (None: not cached) keyed by an MD5 of `description`.
    """

    def __init__(
        self,
        low_level: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        options: GPTDatasetOptions,
        cache_dir: str | None = None,
    ) -> None:
        self.dataset = low_level
        self.path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.options = options
        self.seq_length = options.seq_length
        self.pad_id = options.pad if options.pad is not None else PAD_WHEN_NO_PAD_TOKEN
        tokens = int(np.asarray(low_level.sequence_lengths)[indices].sum(dtype=np.int64))
        if tokens == 0:
            raise GigatronError(
                f"--split {options.split}: the {index_split} split of "
                f"{dataset_path or 'the mock data'} holds no tokens ({len(indices)} of "
                f"{len(low_level)} sequences) but samples are asked of it; change "
                f"--split to give {index_split} a larger share, or give --{index_split}-data-path"
            )
        self.description = json.dumps(
            OrderedDict(
                [
                    ("class", "GPTDataset"),
                    ("dataset_path", dataset_path),
                    ("num_samples", num_samples),
                    ("index_split", index_split),
                    ("random_seed", options.seed),
                    ("sequence_length", options.seq_length),
                    ("split", options.split),
                    ("split_matrix", options.split_matrix),
                    ("tokenizer", options.tokenizer_identifiers),
                ]
            ),
            indent=4,
        )
        self.unique_description_hash = hashlib.md5(self.description.encode("utf-8")).hexdigest()
        self.loaded_from_cache = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(cache_dir)

    def cache_files(self, cache_dir: str) -> dict[str, str]:
        base = os.path.join(
            cache_dir, f"{self.unique_description_hash}-GPTDataset-{self.index_split}"
        )
        names = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
        return {name: f"{base}-{name}" for name in names}

    def _load_or_build(self, cache_dir: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        files = self.cache_files(cache_dir) if cache_dir else None
        if files and all(os.path.isfile(path) for path in files.values()):
            self.loaded_from_cache = True
            return tuple(  # type: ignore[return-value]
                np.load(files[name], mmap_mode="r", allow_pickle=False)
                for name in ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
            )
        arrays = build_all_indices(
            self.dataset.sequence_lengths,
            self.indices,
            self.seq_length,
            self.num_samples,
            self.options.seed,
        )
        if files:
            try:
                os.makedirs(cache_dir, exist_ok=True)
                names = ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
                for name, array in zip(names, arrays):
                    _save_atomic(files[name], array)
                # The description goes last: its presence marks a complete entry.
                tmp = f"{files['description.txt']}.{os.getpid()}.tmp"
                with open(tmp, "w") as handle:
                    handle.write(self.description)
                os.replace(tmp, files["description.txt"])
            except OSError as exc:
                # A read-only data directory should not stop training: the indices are in memory.
                warnings.warn(
                    f"cannot write the dataset index cache in {cache_dir} ({exc}); continuing "
                    "without it; give a writable directory with --data-cache-path",
                    stacklevel=2,
                )
        return arrays

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
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        text, real = self.text(int(index) % len(self))
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
            keys = positions[None, :]
            allowed = (keys <= positions[:, None]) & (keys >= segment_start[:, None])
            sample["attention_mask"] = ~allowed[None]
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
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def _open_indexed(prefix: str, flag: str) -> Any:
    from gigatron.data.indexed import IndexedDataset, missing_files

    missing = missing_files(prefix)
    if missing:
        raise GigatronError(
            f"{flag} {prefix}: {' and '.join(missing)} not found; give the prefix without "
            "extension of a dataset written by `gigatron preprocess`"
        )
    return IndexedDataset(prefix)


class _Builder:
    """Shared state while building the datasets of one configuration."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        data = cfg.data
        if cfg.model.seq_length is None:
            raise GigatronError("--seq-length is required to build GPT datasets")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.surplus = float(data.mid_level_dataset_surplus)
        self.cache_path = data.data_cache_path
        self.opened: dict[str, Any] = {}
        self.base_options = dict(
            seq_length=int(cfg.model.seq_length),
            seed=int(cfg.training.seed),
            eod_mask_loss=bool(data.eod_mask_loss),
            reset_position_ids=bool(data.reset_position_ids),
            reset_attention_mask=bool(data.reset_attention_mask),
            create_attention_mask=bool(data.create_attention_mask_in_dataloader),
        )

    def options(self, split: str | None, matrix: list[Bookend]) -> GPTDatasetOptions:
        return GPTDatasetOptions.from_tokenizer(
            self.tokenizer, split=split, split_matrix=matrix, **self.base_options
        )

    def low_level(self, prefix: str, flag: str) -> Any:
        if prefix not in self.opened:
            self.opened[prefix] = _open_indexed(prefix, flag)
        return self.opened[prefix]

    def cache_dir(self, prefix: str | None) -> str | None:
        if self.cache_path:
            return self.cache_path
        return default_cache_dir(prefix) if prefix else None

    def member(
        self,
        prefix: str,
        flag: str,
        split_index: int,
        split: str | None,
        matrix: list[Bookend],
        num_samples: int | None,
        required: bool = False,
    ) -> GPTDataset | None:
        low_level = self.low_level(prefix, flag)
        indices = split_indices(len(low_level), matrix[split_index])
        if indices is None:
            return None
        empty = not np.asarray(low_level.sequence_lengths)[indices].any()
        if empty and not (num_samples or required):
            return None  # an empty split nobody asks samples of is simply absent
        return GPTDataset(
            low_level,
            prefix,
            indices,
            num_samples,
            SPLIT_NAMES[split_index],
            self.options(split, matrix),
            self.cache_dir(prefix),
        )

    def blend(
        self,
        prefixes: list[str],
        weights: list[float] | None,
        flag: str,
        split_index: int,
        split: str | None,
        matrix: list[Bookend],
        target: int | None,
    ) -> Any:
        """One dataset, or a BlendedDataset of several, for one split."""
        if len(prefixes) == 1:
            return self.member(prefixes[0], flag, split_index, split, matrix, target)
        name = SPLIT_NAMES[split_index]
        if matrix[split_index] is None:
            return None
        if weights is not None and target is not None:
            weights = normalize_weights(weights, flag)
            requests = member_sample_counts(target, weights, self.surplus)
            size = target
        else:
            # No weights (or no target): each member once, in proportion to its size.
            requests = [None] * len(prefixes)
            size = None
        members = [
            self.member(prefix, flag, split_index, split, matrix, request, bool(target))
            for prefix, request in zip(prefixes, requests)
        ]
        if target == 0 or any(m is None for m in members):
            return None  # nothing is asked of this split (empty members are errors otherwise)
        if size is None:
            weights = [float(len(m)) for m in members]
            size = int(sum(len(m) for m in members))
            if target is not None and target > size:
                # More than one pass is needed: ask each member for its share plus the surplus.
                weights = normalize_weights(weights, flag)
                requests = member_sample_counts(target, weights, self.surplus)
                members = [
                    self.member(prefix, flag, split_index, split, matrix, request)
                    for prefix, request in zip(prefixes, requests)
                ]
                size = target
        described = {m.unique_description_hash: m.path for m in members}
        # Megatron caches blends only under --data-cache-path; a blend of millions of samples
        # takes seconds to draw, so gigatron also keeps it next to the first member's data.
        cache = self.cache_path or os.path.join(
            os.path.dirname(os.path.abspath(prefixes[0])), "cache", "BlendedDataset_indices"
        )
        return BlendedDataset(members, weights, size, name, cache, described)


def build_gpt_datasets(
    cfg: Any,
    tokenizer: Any,
    num_samples: tuple[int | None, int | None, int | None],
    pctx: Any = None,
) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets of the configuration; None for a split that is absent.

    With a ParallelContext of several ranks, rank 0 builds (and caches) the indices first and the
    others then load them, so the work is not repeated on every rank.
    """
    if pctx is not None and getattr(pctx, "world_size", 1) > 1:
        if pctx.rank == 0:
            result = _build(cfg, tokenizer, num_samples)
        pctx.barrier()
        if pctx.rank != 0:
            result = _build(cfg, tokenizer, num_samples)
        return result
    return _build(cfg, tokenizer, num_samples)


def _build(cfg: Any, tokenizer: Any, num_samples: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    data = cfg.data
    builder = _Builder(cfg, tokenizer)
    per_split = [data.train_data_path, data.valid_data_path, data.test_data_path]
    if data.mock_data:
        return _build_mock(builder, cfg, tokenizer, num_samples)
    if any(per_split):
        if data.data_path:
            raise GigatronError(
                "--data-path and --train/valid/test-data-path were both given; use one form"
            )
        result = []
        for i, paths in enumerate(per_split):
            if not paths:
                result.append(None)
                continue
            flag = f"--{SPLIT_NAMES[i]}-data-path"
            prefixes, weights = parse_blend(paths, flag)
            # The whole of each dataset serves this split.
            matrix: list[Bookend] = [None, None, None]
            matrix[i] = (0, 1)
            result.append(builder.blend(prefixes, weights, flag, i, None, matrix, num_samples[i]))
        return tuple(result)  # type: ignore[return-value]
    if not data.data_path:
        raise GigatronError(
            "no training data: give --data-path PREFIX (or --train-data-path ...), "
            "or --mock-data for synthetic tokens"
        )
    split = data.split
    if split is None:
        warnings.warn(
            f"--split not given; using the legacy default --split '{DEFAULT_SPLIT}'", stacklevel=2
        )
        split = DEFAULT_SPLIT
    matrix = split_matrix(parse_split(split))
    prefixes, weights = parse_blend(data.data_path, "--data-path")
    return tuple(  # type: ignore[return-value]
        builder.blend(prefixes, weights, "--data-path", i, split, matrix, num_samples[i])
        for i in range(3)
    )


def _build_mock(
    builder: _Builder, cfg: Any, tokenizer: Any, num_samples: tuple[Any, Any, Any]
) -> tuple[Any, Any, Any]:
    eod = getattr(tokenizer, "eod", None)
    vocab = getattr(tokenizer, "vocab_size", None) or ((eod or 0) + 1)
    low_level = MockTokenDataset(vocab, eod if eod is not None else vocab - 1)
    split = cfg.data.split or MOCK_SPLIT
    matrix = split_matrix(parse_split(split))
    options = builder.options(split, matrix)
    result = []
    for i, name in enumerate(SPLIT_NAMES):
        indices = split_indices(len(low_level), matrix[i])
        if indices is None:
            result.append(None)
            continue
        result.append(GPTDataset(low_level, None, indices, num_samples[i], name, options, None))
    return tuple(result)  # type: ignore[return-value]
