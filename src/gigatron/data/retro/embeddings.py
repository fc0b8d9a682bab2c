"""Embedding the chunk database: every chunk's text through a BERT embedder, in blocks of
--retro-block-size chunks saved as they finish (a killed run resumes; the ranks share the blocks).

The blocks live under db/embeddings/<key>/, the key naming the database and the embedder, so an
index never mixes embeddings of two models or two databases.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gigatron.data.retro.blocks import block_path, block_ranges, run_blocks
from gigatron.data.retro.project import ProjectDir

Embed = Callable[[list[np.ndarray]], np.ndarray]  # GPT token chunks -> float32 [n, dim]


def embeddings_key(database_identity: str, embedder: dict[str, Any]) -> str:
    text = json.dumps({"database": database_identity, "embedder": embedder}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def embeddings_dir(project: ProjectDir, key: str) -> Path:
    return project.embeddings / key


def embed_database(
    project: ProjectDir,
    database: Any,
    embed: Embed,
    key: str,
    block_size: int,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Embed every chunk of `database` (a ChunkDatabase) not embedded yet; returns the folder."""
    directory = embeddings_dir(project, key)

    def compute(a: int, b: int) -> np.ndarray:
        return np.asarray(embed([database.real_tokens(i) for i in range(a, b)]), np.float32)

    run_blocks(directory, len(database), block_size, compute, rank, world)
    barrier()
    return directory


def load_embeddings(
    directory: Path, total: int, block_size: int, ids: Sequence[int] | None = None
) -> np.ndarray:
    """float32 [len(ids), dim]: the embeddings of chunks `ids` (all when None), block by block."""
    ranges = block_ranges(total, block_size)
    wanted = np.arange(total) if ids is None else np.asarray(ids, dtype=np.int64)
    parts = []
    for a, b in ranges:
        inside = wanted[(wanted >= a) & (wanted < b)]
        if len(inside):
            block = np.load(block_path(directory, a, b), mmap_mode="r", allow_pickle=False)
            parts.append(np.asarray(block[inside - a], dtype=np.float32))
    return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)


def missing_blocks(directory: Path, total: int, block_size: int) -> list[Path]:
    return [
        block_path(directory, a, b)
        for a, b in block_ranges(total, block_size)
        if not block_path(directory, a, b).is_file()
    ]
