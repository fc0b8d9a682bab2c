"""The GPT samples a split's neighbours are computed for: their chunks and their documents.

A split dataset is a GPTDataset or a BlendedDataset of them (what `pretrain gpt` builds); the
sample's documents are (database dataset, sequence) pairs, as Megatron's query excludes them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from gigatron.errors import GigatronError


def member_sample(dataset: Any, index: int) -> tuple[Any, int]:
    """(the GPTDataset, its sample number) that sample `index` of a split comes from."""
    if hasattr(dataset, "dataset_index"):  # a BlendedDataset
        member = dataset.datasets[int(dataset.dataset_index[index])]
        return member, int(dataset.dataset_sample_index[index])
    return dataset, index


def sample_documents(member: Any, index: int) -> np.ndarray:
    """Sequence ids of the documents that sample `index` of a GPTDataset reads."""
    j = int(member.shuffle_index[index])
    first, last = int(member.sample_index[j][0]), int(member.sample_index[j + 1][0])
    return np.asarray(member.document_index[first : last + 1], dtype=np.int64)


class SampleChunks:
    """Chunk c of sample i is tokens [c * chunk_length, (c + 1) * chunk_length) of the sample."""

    def __init__(
        self, dataset: Any, prefixes: Sequence[str], seq_length: int, chunk_length: int
    ) -> None:
        if seq_length % chunk_length:
            raise GigatronError(
                f"--seq-length {seq_length}: not a multiple of --retro-gpt-chunk-length "
                f"{chunk_length}; Retro splits each sample into whole chunks, choose a "
                "sequence length that the chunk length divides"
            )
        self.dataset = dataset
        self.seq_length, self.chunk_length = seq_length, chunk_length
        self.chunks_per_sample = seq_length // chunk_length
        self.dataset_ids = {os.path.abspath(p): d for d, p in enumerate(prefixes)}

    def __len__(self) -> int:
        return len(self.dataset) * self.chunks_per_sample

    def database_id(self, member: Any) -> int:
        path = os.path.abspath(str(member.path))
        if path not in self.dataset_ids:
            raise GigatronError(
                f"--data-path: {member.path} is not one of the datasets the Retro database was "
                f"built from ({', '.join(self.dataset_ids)}); build the database from the same "
                "--data-path"
            )
        return self.dataset_ids[path]

    def sample(self, index: int) -> tuple[np.ndarray, int, np.ndarray]:
        """(seq_length tokens, database dataset id, document ids) of sample `index`."""
        member, j = member_sample(self.dataset, index)
        text, _ = member.text(j)
        return text[: self.seq_length], self.database_id(member), sample_documents(member, j)

    def tokens(self, start: int, end: int) -> list[np.ndarray]:
        """Tokens of chunks [start, end) (ids counted over all samples)."""
        out, cached = [], (-1, None)
        for chunk in range(start, end):
            s, c = divmod(chunk, self.chunks_per_sample)
            if cached[0] != s:
                cached = (s, self.sample(s)[0])
            out.append(cached[1][c * self.chunk_length : (c + 1) * self.chunk_length])
        return out
