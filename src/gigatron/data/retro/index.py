"""index-train and index-add: a Faiss index of the database embeddings (--retro-index-str).

`--retro-index-str` is a `faiss.index_factory` string (Flat, IVF<n>,Flat, IVF<n>,PQ<m>,
HNSW<m>, OPQ<m>_<d>,IVF<n>_HNSW<m>,PQ<m>, ...). index-train trains it on --retro-index-ntrain
chunks spread evenly over the database; index-add adds the first --retro-index-add-load-fraction
of the chunks. Both write under index/<name>/ with a meta.json naming the database and
embeddings they were made from: an index of another database is refused, never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gigatron.data.retro.project import ProjectDir, read_json, temporary, write_json
from gigatron.errors import GigatronError

TRAINED, ADDED = "trained.faissindex", "added.faissindex"


def import_faiss() -> Any:
    try:
        import faiss  # why: optional dependency (pip install 'gigatron[retro]')
    except ImportError:
        raise GigatronError(
            "retro-preprocess index-train/index-add/query-neighbors: faiss is not installed; "
            "pip install 'gigatron[retro]' (faiss-cpu)"
        ) from None
    return faiss


def index_name(index_str: str) -> str:
    """A folder name for an index string ('IVF64,Flat' -> 'IVF64_Flat')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", index_str)


def make_index(index_str: str, dim: int) -> Any:
    faiss = import_faiss()
    try:
        return faiss.index_factory(dim, index_str)
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[-1]
        raise GigatronError(
            f"--retro-index-str {index_str!r}: Faiss cannot build it ({reason}); give a "
            "faiss.index_factory string such as Flat, IVF1024,Flat, IVF1024,PQ32 or HNSW32"
        ) from None


def training_ids(total: int, ntrain: int) -> np.ndarray:
    """`ntrain` chunk ids spread evenly over the database."""
    if not 0 < ntrain <= total:
        raise GigatronError(
            f"--retro-index-ntrain {ntrain}: the database has {total} chunks; train on 1.."
            f"{total} of them"
        )
    return np.unique(np.linspace(0, total - 1, ntrain).round().astype(np.int64))


def write_index(index: Any, path: Path) -> None:
    faiss = import_faiss()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    faiss.write_index(index, str(tmp))
    os.replace(tmp, path)


def read_index(path: Path, fix: str) -> Any:
    if not path.is_file():
        raise GigatronError(f"{path}: not found; {fix}")
    return import_faiss().read_index(str(path))


def meta_identity(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def train_index(
    project: ProjectDir, index_str: str, embeddings: np.ndarray, source: dict[str, Any]
) -> None:
    """Train `index_str` on `embeddings`; `source` names the database and embeddings."""
    index = make_index(index_str, embeddings.shape[1])
    if not index.is_trained:
        index.train(np.ascontiguousarray(embeddings, dtype=np.float32))
    folder = project.index_dir(index_name(index_str))
    write_index(index, folder / TRAINED)
    meta = {**source, "index_str": index_str, "ntrain": len(embeddings)}
    write_json(folder / "trained.json", meta)


def check_source(path: Path, meta: dict[str, Any], source: dict[str, Any], fix: str) -> None:
    """The index in `path` was made from the database and embeddings `source` names."""
    if meta.get("db_identity") != source["db_identity"]:
        raise GigatronError(
            f"{path}: built for another chunk database than this project's db/; {fix}"
        )
    if meta.get("embeddings") != source["embeddings"]:
        raise GigatronError(f"{path}: built from other embeddings (another BERT model); {fix}")


def trained_meta(project: ProjectDir, index_str: str, source: dict[str, Any]) -> dict[str, Any]:
    folder = project.index_dir(index_name(index_str))
    fix = f"run --retro-tasks index-train with --retro-index-str {index_str!r} first"
    meta = read_json(folder / "trained.json", fix)
    check_source(folder / TRAINED, meta, source, fix.replace(" first", " again"))
    return meta


def add_to_index(
    project: ProjectDir,
    index_str: str,
    blocks: Iterable[np.ndarray],
    source: dict[str, Any],
    add_load_fraction: float,
) -> None:
    """Add the embedding `blocks` (the first fraction of the database's chunks, in order, one
    block in memory at a time) to the trained index."""
    folder = project.index_dir(index_name(index_str))
    trained = trained_meta(project, index_str, source)
    index = read_index(folder / TRAINED, "run --retro-tasks index-train first")
    for block in blocks:
        index.add(np.ascontiguousarray(block, dtype=np.float32))
    write_index(index, folder / ADDED)
    meta = {
        **source,
        "index_str": index_str,
        "trained": meta_identity(trained),
        "add_load_fraction": add_load_fraction,
        "ntotal": int(index.ntotal),
    }
    write_json(folder / "added.json", meta)


def open_index(project: ProjectDir, index_str: str, source: dict[str, Any]) -> tuple[Any, str]:
    """(the filled index, its identity) for querying, checked against `source`."""
    folder = project.index_dir(index_name(index_str))
    fix = f"run --retro-tasks index-add with --retro-index-str {index_str!r}"
    meta = read_json(folder / "added.json", fix)
    check_source(folder / ADDED, meta, source, fix + " (and index-train) again")
    return read_index(folder / ADDED, fix), meta_identity(meta)


def set_search_parameters(index: Any, nprobe: int, ef_search: int) -> None:
    """--retro-query-nprobe (IVF) and --retro-query-ef-search (HNSW), where the index has them."""
    faiss = import_faiss()
    space = faiss.ParameterSpace()
    for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
        try:
            space.set_index_parameter(index, name, int(value))
        except RuntimeError:
            pass  # this index has no such parameter (e.g. a Flat index): nothing to set


def search(index: Any, queries: np.ndarray, k: int) -> np.ndarray:
    """int64 [n, k]: ids of the k nearest chunks (-1 where the index has fewer)."""
    _, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return ids.astype(np.int64)
