"""The Retro project directory: where each preprocessing step keeps its files, written atomically.

    <project>/config.json                 the GPT data and chunking the project was built for
    <project>/db/meta.json                the chunk database: datasets, chunk count, identity
    <project>/db/blocks/<n>-docs/<d>/<a>-<b>.npy  chunk rows of documents [a, b) of dataset d
    <project>/db/chunks.npy               int64 [chunks, 5]: dataset, document, start, end, bert length
    <project>/db/embeddings/<a>-<b>.npy   float32 embeddings of chunks [a, b)
    <project>/index/<name>/...            a trained / filled Faiss index and its meta.json
    <project>/query/<split>/meta.json     what the split's neighbours were computed for
    <project>/query/<split>/neighbors.npy int64 [samples, chunks per sample, neighbours saved]

A file's presence means it is complete: every file is written under a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gigatron.data.indexed import require_dataset
from gigatron.errors import GigatronError

FORMAT = "gigatron-retro-1"
SPLITS = ("train", "valid", "test")


class ProjectDir:
    """Paths of one Retro project directory (`--retro-project-dir`)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.config = self.root / "config.json"
        self.db = self.root / "db"  # the chunk database: meta, chunks, blocks, embeddings
        self.db_meta, self.chunks = self.db / "meta.json", self.db / "chunks.npy"
        self.embeddings = self.db / "embeddings"

    def db_blocks(self, dataset: int, doc_block_size: int) -> Path:
        return self.db / "blocks" / f"{doc_block_size}-docs" / str(dataset)

    def index_dir(self, name: str) -> Path:
        return self.root / "index" / name

    def query_dir(self, split: str) -> Path:
        return self.root / "query" / split

    def neighbors(self, split: str) -> Path:
        return self.query_dir(split) / "neighbors.npy"

    def query_meta(self, split: str) -> Path:
        return self.query_dir(split) / "meta.json"


def temporary(path: Path) -> Path:
    """A name next to `path` for writing it (same directory, so the rename is atomic)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_array(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    with open(tmp, "wb") as handle:
        np.save(handle, array, allow_pickle=False)
    os.replace(tmp, path)


def read_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; a missing or damaged file is an error naming `fix`."""
    if not path.is_file():
        raise GigatronError(f"{path}: not found; {fix}")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GigatronError(f"{path}: unreadable ({error}); {fix}") from None
    if not isinstance(value, dict):
        raise GigatronError(f"{path}: not a JSON object; {fix}")
    return value


def read_array(path: Path, fix: str, mmap: bool = True) -> np.ndarray:
    if not path.is_file():
        raise GigatronError(f"{path}: not found; {fix}")
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise GigatronError(f"{path}: unreadable ({error}); {fix}") from None


def file_digest(path: str | os.PathLike, limit: int | None = None) -> str:
    """SHA-256 of a file (its first `limit` bytes when given), streamed."""
    digest = hashlib.sha256()
    remaining = limit
    with open(path, "rb") as handle:
        while remaining is None or remaining > 0:
            size = 1 << 20 if remaining is None else min(1 << 20, remaining)
            block = handle.read(size)
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest.hexdigest()


def dataset_fingerprint(prefix: str) -> str:
    """Identity of a .bin/.idx dataset: the whole .idx file and the .bin's size and first MiB."""
    require_dataset(prefix)
    bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
    parts = [file_digest(idx_path), str(os.path.getsize(bin_path)), file_digest(bin_path, 1 << 20)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()
