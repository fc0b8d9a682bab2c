"""db-build: the chunk database of the GPT datasets (Megatron's retro `db-build` task).

Each document (a sequence of the .bin/.idx dataset) loses its trailing eod and is cut into
chunks of --retro-gpt-chunk-length tokens (the last may be shorter). A chunk whose text gives no
BERT token is left out (Megatron's 'invalid' chunks). A row is (dataset, document, start, end,
BERT length); documents are processed in blocks of --retro-doc-block-size, saved as they finish.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from gigatron.data.indexed import IndexedDataset
from gigatron.data.retro.blocks import read_blocks, run_blocks
from gigatron.data.retro.project import (
    ProjectDir,
    dataset_fingerprint,
    file_digest,
    write_array,
    write_json,
)

COLUMNS = ("dataset", "document", "start", "end", "bert_length")


def document_chunks(
    dataset: IndexedDataset,
    dataset_id: int,
    documents: range,
    chunk_length: int,
    eod: int,
    chunk_text: Callable[[np.ndarray], str],
    bert_length: Callable[[str], int],
) -> np.ndarray:
    """int64 [chunks, 5]: the valid chunks of `documents`."""
    rows = []
    for document in documents:
        tokens = dataset.get(document)
        size = len(tokens) - 1 if len(tokens) and int(tokens[-1]) == eod else len(tokens)
        for start in range(0, size, chunk_length):
            end = min(size, start + chunk_length)
            length = bert_length(chunk_text(tokens[start:end]))
            if length > 0:
                rows.append((dataset_id, document, start, end, length))
    return np.asarray(rows, dtype=np.int64).reshape(-1, len(COLUMNS))


def build_database(
    project: ProjectDir,
    prefixes: Sequence[str],
    chunk_length: int,
    eod: int,
    chunk_text: Callable[[np.ndarray], str],
    bert_length: Callable[[str], int],
    doc_block_size: int,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> None:
    """Chunk every dataset (blocks shared by the ranks), then rank 0 writes chunks.npy and
    meta.json. Blocks already on disk are kept, so a killed run resumes."""
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    for d, dataset in enumerate(datasets):

        def compute(a: int, b: int, dataset: IndexedDataset = dataset, d: int = d) -> np.ndarray:
            return document_chunks(
                dataset, d, range(a, b), chunk_length, eod, chunk_text, bert_length
            )

        run_blocks(
            project.db_blocks(d, doc_block_size), len(dataset), doc_block_size, compute, rank, world
        )
    barrier()
    if rank == 0:
        parts = [
            block
            for d, dataset in enumerate(datasets)
            for block in read_blocks(
                project.db_blocks(d, doc_block_size), len(dataset), doc_block_size
            )
        ]
        chunks = np.concatenate(parts) if parts else np.zeros((0, len(COLUMNS)), np.int64)
        write_array(project.chunks, chunks)
        entries = [{"prefix": p, "fingerprint": dataset_fingerprint(p)} for p in prefixes]
        identity = hashlib.sha256(
            (file_digest(project.chunks) + repr(entries) + f"{chunk_length}/{eod}").encode()
        ).hexdigest()
        write_json(
            project.db_meta,
            {
                "datasets": entries,
                "chunk_length": chunk_length,
                "eod": eod,
                "num_chunks": len(chunks),
                "columns": list(COLUMNS),
                "identity": identity,
            },
        )
    barrier()
