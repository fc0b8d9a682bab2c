"""One dataset builder for every model family: data paths, splits, blends, mock data, ranks.

`build_datasets(dataset_class, cfg, tokenizer, num_samples, pctx)` returns the (train, valid,
test) datasets of a configuration, following Megatron-Core's BlendedMegatronDatasetBuilder:

- `--data-path P` with `--split`: each split of P reads its share of P's elements (documents or
  sequences, as the dataset class counts them) and is asked for its requested samples;
- `--data-path w1 P1 w2 P2 ...`: member d of each split is asked for
  `ceil(ceil(n * w_d) * (1 + surplus))` samples and the blend holds `sum_d ceil(n * w_d)`;
- `--data-path P1 P2 ...` (no weights): each member is read once (one pass) and the blend holds
  `min(n, sum of the member lengths)` samples, in proportion to the member lengths;
- `--train-data-path` / `--valid-data-path` / `--test-data-path`: each split reads whole datasets;
  a single prefix is a plain dataset (its weight, if any, is ignored), several form a blend as above;
- `--mock-data`: the dataset class's synthetic documents, split `1,1,1` unless `--split` is given.

A dataset class provides (see GPTDataset and BertDataset):
    cache_name: str                                      cache directory and file names
    options_from_config(cfg, tokenizer) -> options       checks the flags it needs; a dataclass
                                                         with `split` and `split_matrix` fields
    numel_low_level_dataset(low_level) -> int            elements that --split divides
    holds_data(low_level, indices) -> bool               whether a split has anything to read
    build_mock_low_level(cfg, tokenizer) -> low_level    for --mock-data
    cls(low_level, dataset_path, indices, num_samples, index_split, options, cache_dir)
    open_low_level(path, flag, cfg, tokenizer) -> low_level   optional: how a path is read
                                                         (default: an IndexedDataset prefix)
and its instances `path`, `unique_identifiers` (a dict) and `len()`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from gigatron.config.data import parse_split
from gigatron.data.blend import BlendedDataset, member_sample_counts, normalize_weights
from gigatron.data.index_cache import IndexCache, describe
from gigatron.data.indexed import (
    IndexedDataset,
    dataset_exists,
    missing_dataset_hint,
    missing_files,
)
from gigatron.errors import GigatronError

SPLIT_NAMES = ("train", "valid", "test")
# What Megatron uses (and warns about) when --data-path comes without --split.
DEFAULT_SPLIT = "969, 30, 1"
MOCK_SPLIT = "1,1,1"

Bookend = tuple[float, float] | None
Splits = tuple[Any, Any, Any]


class SplitDataset:
    """What the dataset classes share: the constructor `build_datasets` calls, which keeps its
    arguments and then calls the class's `build_indices(where, cache_dir)`."""

    def __init__(
        self,
        low_level: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        options: Any,
        cache_dir: str | None = None,
    ) -> None:
        self.dataset = low_level
        self.path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.options = options
        self.seq_length = options.seq_length
        self.build_indices(
            f"the {index_split} split of {dataset_path or 'the mock data'}", cache_dir
        )

    def build_indices(self, where: str, cache_dir: str | None) -> None:
        """Check the split (`where` names it in errors) and load or build its sample indices."""
        raise NotImplementedError

    @classmethod
    def build_splits(
        cls,
        cfg: Any,
        tokenizer: Any,
        num_samples: tuple[int | None, int | None, int | None],
        pctx: Any = None,
    ) -> Splits:
        """(train, valid, test) datasets of this class for the configuration (`build_datasets`)."""
        return build_datasets(cls, cfg, tokenizer, num_samples, pctx)

    def identifiers(self, class_name: str) -> dict[str, Any]:
        """Megatron-Core's description keys that every dataset has (its cache depends on them)."""
        options = self.options
        return {
            "class": class_name,
            "dataset_path": self.path,
            "num_samples": self.num_samples,
            "index_split": self.index_split,
            "random_seed": options.seed,
            "sequence_length": options.seq_length,
            "split": options.split,
            "split_matrix": options.split_matrix,
            "tokenizer": options.tokenizer_identifiers,
        }

    def load_indices(
        self, cache_dir: str | None, stem: str, names: Sequence[str], build: Callable[[], Any]
    ) -> list[np.ndarray]:
        """The index arrays `names`, from the cache entry of `unique_identifiers` in `cache_dir`
        (file names `<hash>-<stem>-<name>`) or built (and saved there) by `build()`."""
        self.description = describe(self.unique_identifiers)
        cache = IndexCache(cache_dir, stem, self.description)
        self.unique_description_hash = cache.hash
        loaded, self.loaded_from_cache = cache.load_or_build(names, build)
        return loaded

    def position(self, index: int) -> int:
        """`index` (negative counts from the end) as a position in [0, len)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        return int(index) % len(self)


# ----------------------------------------------------------------------------------------------
# --split and --data-path parsing


def split_matrix(proportions: list[float]) -> list[Bookend]:
    """Bookends [(lo, hi)] of each split in [0, 1]; None for an empty split."""
    edges = [0, *accumulate(proportions)]
    return [(lo, hi) if hi - lo > 0 else None for lo, hi in zip(edges[:-1], edges[1:])]


def split_indices(num_elements: int, bookend: Bookend) -> np.ndarray | None:
    """Element ids [round(lo * N), round(hi * N)) of a split (contiguous, unshuffled)."""
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


def default_cache_dir(prefix: str, cache_name: str) -> str:
    """`<directory of the dataset>/cache/<cache_name>_indices` (Megatron uses `<prefix>/cache`)."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", f"{cache_name}_indices")


def open_indexed_dataset(prefix: str, flag: str) -> Any:
    missing = missing_files(prefix)
    if missing:
        raise GigatronError(
            f"{flag} {prefix}: {' and '.join(missing)} not found; give the prefix without "
            f"extension of a dataset written by `gigatron preprocess`{missing_dataset_hint(prefix)}"
        )
    return IndexedDataset(prefix)


# ----------------------------------------------------------------------------------------------
# The builder


class DatasetBuilder:
    """Builds the three splits of one configuration for `dataset_class`."""

    def __init__(self, dataset_class: type, cfg: Any, tokenizer: Any) -> None:
        self.dataset_class = dataset_class
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.base_options = dataset_class.options_from_config(cfg, tokenizer)
        self.surplus = float(cfg.data.mid_level_dataset_surplus)
        self.cache_path = cfg.data.data_cache_path
        self.opened: dict[str, Any] = {}

    def build(self, num_samples: tuple[int | None, int | None, int | None]) -> Splits:
        data = self.cfg.data
        per_split = [data.train_data_path, data.valid_data_path, data.test_data_path]
        if data.mock_data:
            return self.build_mock(num_samples)
        if any(per_split):
            if data.data_path:
                raise GigatronError(
                    "--data-path and --train/valid/test-data-path were both given; use one form"
                )
            return tuple(  # type: ignore[return-value]
                self.build_split_from_own_paths(i, paths, num_samples[i])
                for i, paths in enumerate(per_split)
            )
        if not data.data_path:
            raise GigatronError(
                "no training data: give --data-path PREFIX (or --train-data-path ...), "
                "or --mock-data for synthetic data"
            )
        split = data.split
        if split is None:
            warnings.warn(
                f"--split not given; using the legacy default --split '{DEFAULT_SPLIT}'",
                stacklevel=3,
            )
            split = DEFAULT_SPLIT
        matrix = split_matrix(parse_split(split))
        prefixes, weights = parse_blend(data.data_path, "--data-path")
        if len(prefixes) == 1 and weights is None:
            return tuple(  # type: ignore[return-value]
                self.member(prefixes[0], "--data-path", i, split, matrix, num_samples[i])
                for i in range(3)
            )
        return tuple(  # type: ignore[return-value]
            self.blend(prefixes, weights, "--data-path", i, split, matrix, num_samples[i])
            for i in range(3)
        )

    def build_split_from_own_paths(
        self, index: int, paths: list[str] | None, target: int | None
    ) -> Any:
        """Split `index` from its --<split>-data-path: the whole of each dataset serves it."""
        if not paths:
            return None
        flag = f"--{SPLIT_NAMES[index]}-data-path"
        prefixes, weights = parse_blend(paths, flag)
        matrix: list[Bookend] = [None, None, None]
        matrix[index] = (0, 1)
        if len(prefixes) == 1:
            return self.member(prefixes[0], flag, index, None, matrix, target)
        return self.blend(prefixes, weights, flag, index, None, matrix, target)

    def options(self, split: str | None, matrix: list[Bookend]) -> Any:
        return dataclasses.replace(self.base_options, split=split, split_matrix=matrix)

    def low_level(self, prefix: str, flag: str) -> Any:
        if prefix not in self.opened:
            opener = getattr(self.dataset_class, "open_low_level", None)
            if opener is not None:
                self.opened[prefix] = opener(prefix, flag, self.cfg, self.tokenizer)
            else:
                self.opened[prefix] = open_indexed_dataset(prefix, flag)
        return self.opened[prefix]

    def cache_dir(self, prefix: str) -> str:
        return self.cache_path or default_cache_dir(prefix, self.dataset_class.cache_name)

    def member(
        self,
        prefix: str,
        flag: str,
        split_index: int,
        split: str | None,
        matrix: list[Bookend],
        num_samples: int | None,
        required: bool = False,
    ) -> Any:
        """One split of one dataset, asked for `num_samples` (None: one pass)."""
        low_level = self.low_level(prefix, flag)
        numel = self.dataset_class.numel_low_level_dataset(low_level)
        indices = split_indices(numel, matrix[split_index])
        if indices is None:
            return None
        if not self.dataset_class.holds_data(low_level, indices) and not (num_samples or required):
            return None  # an empty split nobody asks samples of is simply absent
        return self.dataset_class(
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
        """A BlendedDataset of one split of several datasets (Megatron-Core's sizes)."""
        if matrix[split_index] is None:
            return None
        name = SPLIT_NAMES[split_index]
        weighted = weights is not None and target is not None
        if weighted:
            weights = normalize_weights(weights, flag)
            requests: list[int | None] = list(member_sample_counts(target, weights, self.surplus))
        else:
            # No weights (or no sample count to apply them to): each member once.
            requests = [None] * len(prefixes)
        members = [
            self.member(prefix, flag, split_index, split, matrix, request, bool(target))
            for prefix, request in zip(prefixes, requests)
        ]
        if target == 0 or any(m is None for m in members):
            return None  # nothing is asked of this split (empty members are errors otherwise)
        if weighted:
            size: int | None = sum(math.ceil(target * w) for w in weights)  # type: ignore[union-attr]
        else:
            weights = [len(m) for m in members]
            size = None if target is None else min(target, sum(weights))
            if name == "train" and target is not None and target > sum(weights):
                raise GigatronError(
                    f"{flag} {' '.join(prefixes)}: without weights each dataset is read once, "
                    f"{sum(weights)} training samples in all, but {target} are needed; give "
                    "'weight prefix' pairs to repeat the datasets, or train on fewer samples"
                )
        # Megatron caches blends only under --data-cache-path; a blend of millions of samples
        # takes seconds to draw, so gigatron also keeps it next to the first member's data.
        cache = self.cache_path or default_cache_dir(prefixes[0], "BlendedDataset")
        return BlendedDataset(members, weights, size, name, cache)

    def build_mock(self, num_samples: tuple[int | None, int | None, int | None]) -> Splits:
        low_level = self.dataset_class.build_mock_low_level(self.cfg, self.tokenizer)
        split = self.cfg.data.split or MOCK_SPLIT
        matrix = split_matrix(parse_split(split))
        numel = self.dataset_class.numel_low_level_dataset(low_level)
        result = []
        for i, name in enumerate(SPLIT_NAMES):
            indices = split_indices(numel, matrix[i])
            if indices is None:
                result.append(None)
                continue
            options = self.options(split, matrix)
            result.append(
                self.dataset_class(low_level, None, indices, num_samples[i], name, options, None)
            )
        return tuple(result)  # type: ignore[return-value]


def build_datasets(
    dataset_class: type,
    cfg: Any,
    tokenizer: Any,
    num_samples: tuple[int | None, int | None, int | None],
    pctx: Any = None,
) -> Splits:
    """(train, valid, test) datasets of `dataset_class` for the configuration; None for a split
    that is absent. `num_samples[i]` is the count asked of split i (None: one pass).

    With a ParallelContext of several ranks, rank 0 builds (and caches) the indices first and the
    others then load them, so the work is not repeated on every rank.
    """
    if pctx is not None and getattr(pctx, "world_size", 1) > 1:
        if pctx.rank == 0:
            try:
                result = DatasetBuilder(dataset_class, cfg, tokenizer).build(num_samples)
            except BaseException:
                pctx.barrier()  # release the other ranks: they meet the same error themselves
                raise
        pctx.barrier()
        if pctx.rank != 0:
            result = DatasetBuilder(dataset_class, cfg, tokenizer).build(num_samples)
        return result
    return DatasetBuilder(dataset_class, cfg, tokenizer).build(num_samples)
