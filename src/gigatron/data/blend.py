"""BlendedDataset: draw samples from several datasets in fixed proportions, deterministically.

Sample i goes to the dataset d with the largest deficit `w_d * max(i, 1) - count_d` (ties to the
lowest d), exactly Megatron-Core's rule, so the first n samples always match the weights within
about one sample for every n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gigatron.data.index_cache import IndexCache, describe
from gigatron.errors import GigatronError

MAX_BLENDED_DATASETS = 32766  # dataset ids are stored as int16


def _greedy_python(weights: list[float], size: int, start: int, counts: list[int], out: np.ndarray):
    # The reference walk; used where the vectorised prediction below keeps failing.
    num = len(weights)
    for i in range(start, start + size):
        scale = i if i > 1 else 1
        best, best_error = 0, weights[0] * scale - counts[0]
        for d in range(1, num):
            error = weights[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        counts[best] += 1
        out[i] = best


def _predict(weights: np.ndarray, counts: np.ndarray, steps: int) -> np.ndarray:
    # Guess the next picks by "earliest due": dataset d's next pick is due at (count_d + j) / w_d.
    ids, keys = [], []
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        n = int(math.ceil(w * steps)) + 2
        keys.append((counts[d] + np.arange(n)) / w)
        ids.append(np.full(n, d, dtype=np.int64))
    all_ids = np.concatenate(ids)
    order = np.lexsort((all_ids, np.concatenate(keys)))
    return all_ids[order[:steps]]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the greedy deficit rule.

    Computed in blocks: a block of picks is guessed with an earliest-due order and checked
    against the exact rule with the same float64 arithmetic; the checked prefix is kept, the
    first wrong pick is replaced by the exact choice. For two datasets the guess is nearly always
    right (whole blocks at numpy speed); where guesses keep failing a plain loop takes over.
    """
    w = np.asarray(weights, dtype=np.float64)
    num = len(w)
    dataset_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(num, dtype=np.int64)
    i, block, slow_steps, backoff = 0, 1024, 0, 4096
    while i < size:
        if slow_steps > 0:
            steps = min(slow_steps, size - i)
            counts_list = counts.tolist()
            _greedy_python(w.tolist(), steps, i, counts_list, dataset_index)
            counts = np.asarray(counts_list, dtype=np.int64)
            i += steps
            slow_steps = 0
            continue
        steps = min(block, size - i)
        guess = _predict(w, counts, steps)
        onehot = np.zeros((steps, num), dtype=np.int64)
        onehot[np.arange(steps), guess] = 1
        before = counts + np.cumsum(onehot, axis=0) - onehot
        scale = np.maximum(np.arange(i, i + steps), 1).astype(np.float64)
        exact = np.argmax(w[None, :] * scale[:, None] - before, axis=1)
        wrong = np.flatnonzero(exact != guess)
        good = steps if wrong.size == 0 else int(wrong[0]) + 1
        picks = exact[:good]  # equal to the guess before the first wrong one
        dataset_index[i : i + good] = picks
        counts += np.bincount(picks, minlength=num)
        i += good
        if good == steps:
            block = min(block * 2, 1 << 20)
            backoff = 4096
        elif good < steps // 4:
            # Guesses keep failing (typical with three or more datasets): run the plain loop,
            # for longer each time, and try guessing again after it.
            block, slow_steps, backoff = 1024, backoff, min(backoff * 2, 1 << 22)
    # The k-th pick of dataset d reads its sample k.
    order = np.argsort(dataset_index, kind="stable")
    group_start = np.concatenate(([0], np.cumsum(np.bincount(dataset_index, minlength=num))))
    sample_index = np.empty(size, dtype=np.int64)
    sample_index[order] = np.arange(size) - group_start[dataset_index[order]]
    return dataset_index.astype(np.int16), sample_index


def normalize_weights(weights: Sequence[float], source: str) -> list[float]:
    values = [float(x) for x in weights]
    if any(x < 0 or not math.isfinite(x) for x in values) or sum(values) <= 0:
        raise GigatronError(
            f"{source}: blend weights {values} must be non-negative with a positive sum"
        )
    total = sum(values)
    return [x / total for x in values]


def member_sample_counts(target: int, weights: Sequence[float], surplus: float) -> list[int]:
    """Samples to ask of each member: ceil(ceil(target * w) * (1 + surplus))."""
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in weights]


class BlendedDataset:
    """Samples of `datasets` mixed by `weights`, `size` samples in all.

    With `size` None the blend is exhaustive: `weights` are sample counts (integers) and dataset
    d gives exactly `weights[d]` samples, drawn in proportion to the counts.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int | None,
        split: str = "train",
        cache_dir: str | None = None,
    ) -> None:
        if not datasets:
            raise GigatronError("blend: no datasets given; name at least one in --data-path")
        if len(datasets) > MAX_BLENDED_DATASETS:
            raise GigatronError(
                f"--data-path: {len(datasets)} datasets in one blend; at most "
                f"{MAX_BLENDED_DATASETS} are supported, merge some with `gigatron merge`"
            )
        if len(weights) != len(datasets):
            raise GigatronError(
                f"blend: {len(weights)} weights for {len(datasets)} datasets; give one each"
            )
        self.datasets = list(datasets)
        if size is None:
            self.weights: list[Any] = [int(w) for w in weights]
            normalized = normalize_weights(self.weights, "--data-path")
            self.size = sum(self.weights)
        else:
            self.weights = normalized = normalize_weights(weights, "--data-path")
            self.size = int(size)
        self.split = split
        # Megatron-Core's description: the members' own descriptions, split, weights, size.
        self.description = describe(
            {
                "class": "BlendedDataset",
                "datasets": [_identifiers(d) for d in self.datasets],
                "split": split,
                "weights": self.weights,
                "size": size,
            }
        )
        cache = IndexCache(cache_dir, f"BlendedDataset-{split}", self.description)
        self.unique_description_hash = cache.hash
        names = ("dataset_index.npy", "dataset_sample_index.npy")
        loaded = cache.load(names)
        if loaded is None:
            loaded = list(build_blending_indices(normalized, self.size))
            cache.save(dict(zip(names, loaded)))
        self.dataset_index, self.dataset_sample_index = loaded
        self._check_sizes()

    def _check_sizes(self) -> None:
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise GigatronError(
                    f"blend ({self.split}): dataset {d} ({getattr(dataset, 'path', '?')}) is "
                    f"asked for {int(count)} samples but has {len(dataset)}; raise "
                    "--mid-level-dataset-surplus (default 0.005)"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        d = int(self.dataset_index[index])
        sample = self.datasets[d][int(self.dataset_sample_index[index])]
        return {"dataset_id": np.int64(d), **sample}


def _identifiers(dataset: Any) -> Any:
    """What identifies a member in a blend's description (its path when it has no description)."""
    identifiers = getattr(dataset, "unique_identifiers", None)
    return dict(identifiers) if identifiers is not None else getattr(dataset, "path", None)
