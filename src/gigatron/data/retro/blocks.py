"""Work in blocks: each block's result is saved as it finishes, so a killed run resumes where it
stopped, and the blocks are dealt round-robin to the data-parallel ranks (Megatron's retro
preprocessing does the same with its --retro-block-size blocks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from gigatron.data.retro.project import write_array
from gigatron.errors import GigatronError


def block_ranges(total: int, block_size: int) -> list[tuple[int, int]]:
    """[(start, end)] covering range(total) in blocks of `block_size` (the last may be short)."""
    return [(a, min(total, a + block_size)) for a in range(0, total, block_size)]


def block_path(directory: Path, start: int, end: int) -> Path:
    return directory / f"{start:012d}-{end:012d}.npy"


def run_blocks(
    directory: Path,
    total: int,
    block_size: int,
    compute: Callable[[int, int], np.ndarray],
    rank: int = 0,
    world: int = 1,
) -> int:
    """Compute and save this rank's missing blocks of range(total); returns how many it computed."""
    done = 0
    for number, (start, end) in enumerate(block_ranges(total, block_size)):
        path = block_path(directory, start, end)
        if number % world != rank or path.is_file():
            continue
        write_array(path, compute(start, end))
        done += 1
    return done


def read_blocks(directory: Path, total: int, block_size: int) -> list[np.ndarray]:
    """Every block of range(total) in order (all ranks must have finished)."""
    paths = [block_path(directory, a, b) for a, b in block_ranges(total, block_size)]
    for path in paths:
        if not path.is_file():
            raise GigatronError(
                f"{path}: not found; a rank did not finish its blocks: run the same command "
                "again (finished blocks are kept)"
            )
    return [np.load(path, allow_pickle=False) for path in paths]
