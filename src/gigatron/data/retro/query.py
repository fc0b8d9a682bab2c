"""query-neighbors: the nearest database chunks of every chunk of every sample of a split.

Each sample chunk is embedded like the database chunks, the index returns its
--retro-query-num-neighbors-query nearest chunks, and those of the sample's own documents are
dropped (Megatron's rule: a neighbour whose (dataset, document) is one of the sample's is
banned); the first --retro-query-num-neighbors-save remain, -1 where fewer are left. Blocks of
--retro-block-size chunks are saved as they finish, under a name of everything they depend on,
so a killed run resumes and a changed input never mixes with old blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gigatron.data.retro.blocks import read_blocks, run_blocks
from gigatron.data.retro.project import ProjectDir, write_array, write_json
from gigatron.data.retro.samples import SampleChunks


@dataclass
class QuerySettings:
    num_neighbors_query: int = 200  # --retro-query-num-neighbors-query
    num_neighbors_save: int = 20  # --retro-query-num-neighbors-save
    block_size: int = 100_000  # --retro-block-size


def filter_neighbors(
    found: np.ndarray, banned: list[set[tuple[int, int]]], db_chunks: np.ndarray, keep: int
) -> np.ndarray:
    """int64 [rows, keep]: each row's found ids minus the banned (dataset, document) ones."""
    out = np.full((len(found), keep), -1, dtype=np.int64)
    for row, (ids, ban) in enumerate(zip(found, banned)):
        ids = ids[ids >= 0]
        owners = db_chunks[ids, :2]
        allowed = [int(i) for i, (d, doc) in zip(ids, owners) if (int(d), int(doc)) not in ban]
        out[row, : min(keep, len(allowed))] = allowed[:keep]
    return out


def query_block(
    chunks: SampleChunks,
    start: int,
    end: int,
    embed: Callable[[list[np.ndarray]], np.ndarray],
    search: Callable[[np.ndarray, int], np.ndarray],
    db_chunks: np.ndarray,
    settings: QuerySettings,
) -> np.ndarray:
    """Neighbours of sample chunks [start, end)."""
    found = search(embed(chunks.tokens(start, end)), settings.num_neighbors_query)
    banned, cached = [], (-1, set())
    for chunk in range(start, end):
        sample = chunk // chunks.chunks_per_sample
        if cached[0] != sample:
            _, dataset_id, documents = chunks.sample(sample)
            cached = (sample, {(dataset_id, int(doc)) for doc in documents})
        banned.append(cached[1])
    return filter_neighbors(found, banned, db_chunks, settings.num_neighbors_save)


def query_split(
    project: ProjectDir,
    split: str,
    chunks: SampleChunks,
    embed: Callable[[list[np.ndarray]], np.ndarray],
    search: Callable[[np.ndarray, int], np.ndarray],
    database: Any,
    identity: dict[str, Any],
    settings: QuerySettings,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> None:
    """Neighbours of every chunk of the split (blocks shared by the ranks); rank 0 then writes
    neighbors.npy and meta.json (`identity`: what they were computed for, plus the counts)."""
    keyed = {**identity, "block_size": settings.block_size, "saved": settings.num_neighbors_save}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    blocks = project.query_dir(split) / f"blocks-{key}"
    db_chunks = np.asarray(database.chunks[:, :2])

    def compute(a: int, b: int) -> np.ndarray:
        return query_block(chunks, a, b, embed, search, db_chunks, settings)

    run_blocks(blocks, len(chunks), settings.block_size, compute, rank, world)
    barrier()
    if rank == 0:
        rows = read_blocks(blocks, len(chunks), settings.block_size)
        flat = np.concatenate(rows) if rows else np.zeros((0, settings.num_neighbors_save))
        samples = len(chunks.dataset)
        neighbors = flat.astype(np.int64).reshape(samples, chunks.chunks_per_sample, -1)
        write_array(project.neighbors(split), neighbors)
        meta = {
            **identity,
            "num_samples": samples,
            "seq_length": chunks.seq_length,
            "chunk_length": chunks.chunk_length,
            "num_neighbors_save": settings.num_neighbors_save,
        }
        write_json(project.query_meta(split), meta)
    barrier()
