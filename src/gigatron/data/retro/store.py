"""RetroNeighbourStore: the saved neighbours of one split, as token arrays per GPT sample.

Sample i of a split is the GPT dataset's sample i (same --data-path, --split, --seed,
--seq-length and sample counts as `pretrain gpt`); its neighbours are
[seq_length // chunk_length, num_neighbors, chunk_length * num_retrieved_chunks] tokens: each
neighbour chunk followed by the database chunks after it (its continuation), as Megatron-Core's
RetroDataset does: database chunk ids wrap around the end of the database, a chunk shorter than
chunk_length (a document's last) is padded with the GPT tokenizer's eod id, and a neighbour slot
the query left empty (id -1: too few candidates outside the sample's own documents) is all eod.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gigatron.data.indexed import IndexedDataset, missing_files
from gigatron.data.retro.project import ProjectDir, dataset_fingerprint, read_array, read_json
from gigatron.errors import GigatronError

QUERY_FIX = (
    "run `gigatron retro-preprocess --retro-tasks query-neighbors` with this project's flags"
)
DB_FIX = "run `gigatron retro-preprocess --retro-tasks db-build` (docs/retro.md)"


class ChunkDatabase:
    """The chunk table of a project and the token datasets it points into."""

    def __init__(self, project: ProjectDir) -> None:
        self.meta = read_json(project.db_meta, DB_FIX)
        self.chunks = read_array(project.chunks, DB_FIX)
        self.chunk_length = int(self.meta["chunk_length"])
        self.eod = int(self.meta["eod"])
        self.identity = str(self.meta["identity"])
        if len(self.chunks) != int(self.meta["num_chunks"]):
            raise GigatronError(
                f"{project.chunks}: {len(self.chunks)} chunks but {project.db_meta} says "
                f"{self.meta['num_chunks']}; the database is damaged, {DB_FIX} again"
            )
        self.datasets = [open_dataset(entry) for entry in self.meta["datasets"]]

    def __len__(self) -> int:
        return int(self.chunks.shape[0])

    def real_tokens(self, chunk_id: int) -> np.ndarray:
        """The chunk's own tokens (no padding)."""
        dataset, document, start, end = (int(x) for x in self.chunks[chunk_id, :4])
        return self.datasets[dataset].get(document, start, end - start)

    def tokens(self, chunk_id: int) -> np.ndarray:
        """int64 [chunk_length]: the chunk's tokens, eod-padded; chunk -1 is all eod."""
        out = np.full(self.chunk_length, self.eod, dtype=np.int64)
        if chunk_id < 0:
            return out
        real = self.real_tokens(chunk_id)
        out[: len(real)] = real
        return out

    def retrieved_tokens(self, first: int, num_retrieved_chunks: int) -> np.ndarray:
        """int64 [chunk_length * num_retrieved_chunks]: neighbour chunk `first` and the chunks
        after it (its continuation; ids wrap around the database's end); -1: all eod."""
        total = len(self)
        parts = [
            self.tokens(-1 if first < 0 else (int(first) + r) % total)
            for r in range(num_retrieved_chunks)
        ]
        return np.concatenate(parts)


def open_dataset(entry: dict[str, str]) -> IndexedDataset:
    """A dataset the database was built from, unchanged since (its fingerprint)."""
    prefix = entry["prefix"]
    missing = missing_files(prefix)
    if missing:
        raise GigatronError(
            f"{prefix}: {' and '.join(missing)} not found, but the Retro database was built "
            "from it; put the dataset back or rebuild the project with --retro-tasks build"
        )
    if dataset_fingerprint(prefix) != entry["fingerprint"]:
        raise GigatronError(
            f"{prefix}: changed since the Retro database was built from it; put the original "
            "back, or build a new project (another --retro-project-dir) from the new data"
        )
    return IndexedDataset(prefix)


class RetroNeighbourStore:
    """Neighbour tokens of every sample of one split of a Retro project."""

    def __init__(
        self,
        project: ProjectDir,
        split: str,
        database: ChunkDatabase,
        neighbors: np.ndarray,
        meta: dict[str, Any],
        num_neighbors: int,
        num_retrieved_chunks: int,
    ) -> None:
        self.project, self.split, self.database = project, split, database
        self.neighbors = neighbors
        self.meta = meta
        self.chunk_length = database.chunk_length
        self.eod = database.eod  # the GPT tokenizer's eod id: short chunks and empty slots
        self.seq_length = int(meta["seq_length"])
        self.num_neighbors = num_neighbors
        self.num_retrieved_chunks = num_retrieved_chunks
        self.dataset_description = str(meta["dataset_description"])

    @classmethod
    def open(
        cls,
        project_dir: str | Path,
        split: str,
        num_neighbors: int = 2,
        num_retrieved_chunks: int = 2,
        seq_length: int | None = None,
        chunk_length: int | None = None,
    ) -> RetroNeighbourStore:
        """The store of `split` ('train', 'valid' or 'test') in `project_dir`; `seq_length` and
        `chunk_length`, when given, must be the ones the neighbours were computed for."""
        project = ProjectDir(project_dir)
        read_json(project.config, f"give the --retro-project-dir that {DB_FIX} wrote")
        database = ChunkDatabase(project)
        meta = read_json(project.query_meta(split), QUERY_FIX)
        neighbors = read_array(project.neighbors(split), QUERY_FIX)
        check_query(project, split, meta, neighbors, database)
        check_lengths(project.query_meta(split), meta, seq_length, chunk_length)
        saved = int(neighbors.shape[2])
        if not 0 < num_neighbors <= saved:
            raise GigatronError(
                f"--retro-num-neighbors {num_neighbors}: {project.neighbors(split)} holds "
                f"{saved} neighbours per chunk; ask for 1..{saved}, or query again with "
                f"--retro-query-num-neighbors-save {num_neighbors}"
            )
        if num_retrieved_chunks < 1:
            raise GigatronError(
                f"--retro-num-retrieved-chunks {num_retrieved_chunks}: must be at least 1 "
                "(the neighbour itself; 2 adds its continuation)"
            )
        return cls(project, split, database, neighbors, meta, num_neighbors, num_retrieved_chunks)

    def __len__(self) -> int:
        return int(self.neighbors.shape[0])

    def neighbor_chunk_ids(self, sample_index: int) -> np.ndarray:
        """int64 [chunks per sample, num_neighbors]: database chunk ids (-1: none)."""
        if not 0 <= sample_index < len(self):
            raise IndexError(f"sample {sample_index} out of range for {len(self)} samples")
        return np.asarray(self.neighbors[sample_index, :, : self.num_neighbors], dtype=np.int64)

    def neighbour_tokens(self, sample_index: int) -> np.ndarray:
        """int64 [seq_length // chunk_length, num_neighbors, chunk_length * num_retrieved_chunks]"""
        ids = self.neighbor_chunk_ids(sample_index)
        out = np.empty((*ids.shape, self.chunk_length * self.num_retrieved_chunks), np.int64)
        for c, row in enumerate(ids):
            for k, first in enumerate(row):
                out[c, k] = self.database.retrieved_tokens(first, self.num_retrieved_chunks)
        return out

    neighbor_tokens = neighbour_tokens  # Megatron's spelling

    def check_dataset(self, dataset: Any) -> None:
        """Raise unless `dataset` (a GPT split dataset) is the one the neighbours were made for."""
        description = getattr(dataset, "description", None)
        if description != self.dataset_description or len(dataset) != len(self):
            raise GigatronError(
                f"{self.project.query_meta(self.split)}: the {self.split} neighbours were "
                f"computed for another GPT dataset ({len(self)} samples) than this run's "
                f"({len(dataset)} samples); give the same --data-path, --split, --seed, "
                "--seq-length and sample counts as retro-preprocess, or "
                f"{QUERY_FIX.replace('run', 'rerun')}"
            )


def check_query(
    project: ProjectDir,
    split: str,
    meta: dict[str, Any],
    neighbors: np.ndarray,
    database: ChunkDatabase,
) -> None:
    """The neighbour file matches its meta.json and the project's current database."""
    where = project.neighbors(split)
    if meta.get("db_identity") != database.identity:
        raise GigatronError(
            f"{where}: computed against another chunk database than {project.db_meta}; "
            f"{QUERY_FIX.replace('run', 'rerun')} (and index-train, index-add before it)"
        )
    seq_length, chunk_length = int(meta["seq_length"]), database.chunk_length
    expected = (int(meta["num_samples"]), seq_length // chunk_length)
    if neighbors.ndim != 3 or tuple(neighbors.shape[:2]) != expected:
        raise GigatronError(
            f"{where}: shape {tuple(neighbors.shape)}, expected {expected} + (neighbours,) "
            f"for {meta['num_samples']} samples of {seq_length} tokens in {chunk_length}-token "
            f"chunks; the file is damaged, {QUERY_FIX.replace('run', 'rerun')}"
        )


def check_lengths(
    where: Path, meta: dict[str, Any], seq_length: int | None, chunk_length: int | None
) -> None:
    """The run's --seq-length and --retro-gpt-chunk-length are the project's."""
    for flag, given, key in (
        ("--seq-length", seq_length, "seq_length"),
        ("--retro-gpt-chunk-length", chunk_length, "chunk_length"),
    ):
        if given is not None and int(given) != int(meta[key]):
            raise GigatronError(
                f"{flag} {given}: {where} holds neighbours for {key.replace('_', ' ')} "
                f"{meta[key]}; give {flag} {meta[key]}, or {QUERY_FIX} and {flag} {given}"
            )
