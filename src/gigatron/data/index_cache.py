"""The dataset index cache: numpy arrays stored under the MD5 of a description of their inputs.

A description is Megatron-Core's: `json.dumps` (indent 4) of an ordered mapping of everything
the arrays depend on (class, dataset path, requested samples, split, seed, ...). Its MD5 names
the files `{md5}-{stem}-{name}`, so any change of an input gives a new entry. Files are written
under a temporary name and renamed, the description last: its presence marks a complete entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

DESCRIPTION = "description.txt"


def describe(fields: Mapping[str, Any]) -> str:
    """The description text of `fields` (in their order), as Megatron-Core writes it."""
    return json.dumps(dict(fields), indent=4)


def description_hash(description: str) -> str:
    return hashlib.md5(description.encode("utf-8")).hexdigest()


class IndexCache:
    """The cache entry of one description in `directory` (None: nothing is cached).

    `stem` is what follows the hash in the file names, e.g. "GPTDataset-train".
    """

    def __init__(self, directory: str | None, stem: str, description: str) -> None:
        self.directory = directory
        self.description = description
        self.hash = description_hash(description)
        self.stem = stem

    def path(self, name: str) -> str:
        return os.path.join(self.directory or "", f"{self.hash}-{self.stem}-{name}")

    def files(self, names: Sequence[str]) -> dict[str, str]:
        """Paths of the description and of the arrays `names`."""
        return {name: self.path(name) for name in (DESCRIPTION, *names)}

    def load(self, names: Sequence[str]) -> list[np.ndarray] | None:
        """The arrays `names` memory-mapped, or None when the entry is missing or incomplete."""
        if self.directory is None:
            return None
        if not all(os.path.isfile(path) for path in self.files(names).values()):
            return None
        return [np.load(self.path(name), mmap_mode="r", allow_pickle=False) for name in names]

    def load_or_build(
        self, names: Sequence[str], build: Callable[[], Sequence[np.ndarray]]
    ) -> tuple[list[np.ndarray], bool]:
        """(the arrays `names`, whether they came from the cache): built and saved when missing."""
        loaded = self.load(names)
        if loaded is not None:
            return loaded, True
        built = list(build())
        self.save(dict(zip(names, built)))
        return built, False

    def save(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Write the arrays, then the description; a directory that cannot be written to only
        warns (the arrays are in memory, training goes on)."""
        if self.directory is None:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            for name, array in arrays.items():
                tmp = f"{self.path(name)}.{os.getpid()}.tmp.npy"
                np.save(tmp, array, allow_pickle=False)
                os.replace(tmp, self.path(name))
            tmp = f"{self.path(DESCRIPTION)}.{os.getpid()}.tmp"
            with open(tmp, "w") as handle:
                handle.write(self.description)
            os.replace(tmp, self.path(DESCRIPTION))
        except OSError as exc:
            warnings.warn(
                f"cannot write the dataset index cache in {self.directory} ({exc}); continuing "
                "without it; give a writable directory with --data-cache-path",
                stacklevel=3,
            )
