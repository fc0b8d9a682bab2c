"""The tasks of `gigatron retro-preprocess`, run in order on every rank (ranks share the blocks).

db-build writes config.json (the datasets, chunk length and GPT tokenizer: a project never
changes them, another set of data needs another --retro-project-dir), the chunk table and its
embeddings; the index tasks read the embeddings named in db/embeddings/current.json; query-
neighbors embeds every split's sample chunks with the same BERT model and searches the index.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from gigatron.data.builder import SPLIT_NAMES, parse_blend
from gigatron.data.retro.database import build_database
from gigatron.data.retro.embeddings import (
    embed_database,
    embeddings_dir,
    embeddings_key,
    load_embeddings,
    missing_blocks,
)
from gigatron.data.retro.index import (
    add_to_index,
    open_index,
    search,
    set_search_parameters,
    train_index,
    training_ids,
)
from gigatron.data.retro.project import (
    FORMAT,
    ProjectDir,
    dataset_fingerprint,
    read_json,
    write_json,
)
from gigatron.data.retro.query import QuerySettings, query_split
from gigatron.data.retro.samples import SampleChunks
from gigatron.data.retro.store import ChunkDatabase
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext, destroy
from gigatron.tasks.retro_embedder import BertChunkEmbedder, load_bert_embedder
from gigatron.training.run import apply_thread_choice


def fraction_count(total: int, fraction: float) -> int:
    """The chunks a load fraction keeps (at least one of a non-empty database)."""
    return max(1, math.floor(total * fraction)) if total else 0


def data_prefixes(cfg: Any) -> list[str]:
    """Every dataset prefix of --data-path or the per-split paths, each once, in order."""
    data, prefixes = cfg.data, []
    sources = [("--data-path", data.data_path)] + [
        (f"--{name}-data-path", getattr(data, f"{name}_data_path")) for name in SPLIT_NAMES
    ]
    for flag, values in sources:
        if values:
            prefixes += [os.path.abspath(p) for p in parse_blend(values, flag)[0]]
    if not prefixes:
        raise GigatronError("no data: give --data-path PREFIX (a `gigatron preprocess` dataset)")
    return list(dict.fromkeys(prefixes))


def tokenizer_identity(tokenizer: Any) -> dict[str, str]:
    """The GPT tokenizer as config.json records it."""
    identifiers = getattr(tokenizer, "unique_identifiers", {})
    identifiers = identifiers() if callable(identifiers) else identifiers
    return {k: str(v) for k, v in dict(identifiers).items()}


class Pipeline:
    """One retro-preprocess run: the project, the GPT tokenizer and (when needed) the embedder."""

    def __init__(self, args: argparse.Namespace, cfg: Any, pctx: ParallelContext) -> None:
        self.args, self.cfg, self.pctx = args, cfg, pctx
        self.project = ProjectDir(args.retro_project_dir)
        self.tokenizer = build_run_tokenizer(cfg)
        self.prefixes = data_prefixes(cfg)
        self._embedder: BertChunkEmbedder | None = None
        self.ranks = {"rank": pctx.rank, "world": pctx.world_size, "barrier": pctx.barrier}

    @property
    def embedder(self) -> BertChunkEmbedder:
        if self._embedder is None:
            a = self.args
            self._embedder = load_bert_embedder(
                a.retro_bert_load, self.pctx, self.tokenizer, a.retro_bert_max_chunk_length,
                a.retro_bert_batch_size,
                {"tokenizer_type": a.retro_bert_tokenizer_type, "vocab_file": a.retro_bert_vocab_file},
            )  # fmt: skip
        return self._embedder

    def project_config(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "datasets": self.prefixes,
            "dataset_fingerprints": [dataset_fingerprint(p) for p in self.prefixes],
            "chunk_length": self.args.retro_gpt_chunk_length,
            "gpt_tokenizer": tokenizer_identity(self.tokenizer),
        }

    def check_project(self, write: bool) -> None:
        """config.json equals this run's data and chunking (written first by db-build)."""
        wanted, path = self.project_config(), self.project.config
        if path.is_file() or not write:
            saved = read_json(path, "run --retro-tasks db-build first")
            if saved != wanted:
                diff = [k for k in wanted if saved.get(k) != wanted[k]]
                raise GigatronError(
                    f"{path}: this project was built for other {', '.join(diff)} than this "
                    f"run's; give the project's own flags, or a new --retro-project-dir for "
                    "other data (nothing was changed)"
                )
        elif self.pctx.rank == 0:
            write_json(path, wanted)
        self.pctx.barrier()

    def source(self) -> dict[str, Any]:
        """The database identity and the embeddings key that index and query depend on."""
        current = read_json(self.project.embeddings / "current.json", "run db-build first")
        database = ChunkDatabase(self.project)
        if current.get("db_identity") != database.identity:
            raise GigatronError(
                f"{self.project.embeddings / 'current.json'}: embeddings of another chunk "
                "database; run --retro-tasks db-build again"
            )
        self.embedding_block_size = int(current["block_size"])
        return {"db_identity": database.identity, "embeddings": current["key"]}

    def run(self, tasks: list[str], sample_counts: Callable[[Any], Any]) -> None:
        self.check_project(write="db-build" in tasks)
        for task in tasks:
            if self.pctx.rank == 0:
                print(f"retro-preprocess: {task} ...", flush=True)
            {
                "db-build": self.db_build,
                "index-train": self.index_train,
                "index-add": self.index_add,
                "query-neighbors": lambda: self.query(sample_counts),
            }[task]()
            self.pctx.barrier()

    def db_build(self) -> None:
        a, embedder = self.args, self.embedder
        build_database(
            self.project, self.prefixes, a.retro_gpt_chunk_length, self.tokenizer.eod,
            embedder.text, embedder.bert_length, a.retro_doc_block_size, **self.ranks,
        )  # fmt: skip
        database = ChunkDatabase(self.project)
        key = embeddings_key(database.identity, embedder.identity)
        embed_database(self.project, database, embedder, key, a.retro_block_size, **self.ranks)
        if self.pctx.rank == 0:
            current = {"key": key, "db_identity": database.identity,
                       "embedder": embedder.identity, "block_size": a.retro_block_size}  # fmt: skip
            write_json(self.project.embeddings / "current.json", current)
            print(f"retro-preprocess: {len(database)} chunks embedded", flush=True)

    def embeddings(self, source: dict[str, Any], ids: Any) -> Any:
        directory = embeddings_dir(self.project, source["embeddings"])
        total = len(ChunkDatabase(self.project))
        missing = missing_blocks(directory, total, self.embedding_block_size)
        if missing:
            raise GigatronError(
                f"{missing[0]}: not found ({len(missing)} embedding blocks missing); run "
                "--retro-tasks db-build again (the blocks still there are kept)"
            )
        return load_embeddings(directory, total, self.embedding_block_size, ids)

    def index_train(self) -> None:
        a, source = self.args, self.source()
        ids = training_ids(len(ChunkDatabase(self.project)), a.retro_index_ntrain)
        ids = ids[: fraction_count(len(ids), a.retro_index_train_load_fraction)]
        if self.pctx.rank == 0:
            train_index(self.project, a.retro_index_str, self.embeddings(source, ids), source)

    def index_add(self) -> None:
        a, source = self.args, self.source()
        count = fraction_count(len(ChunkDatabase(self.project)), a.retro_index_add_load_fraction)
        if self.pctx.rank == 0:
            step = self.embedding_block_size
            blocks = (
                self.embeddings(source, range(start, min(count, start + step)))
                for start in range(0, count, step)
            )  # one block in memory at a time
            add_to_index(
                self.project, a.retro_index_str, blocks, source, a.retro_index_add_load_fraction
            )

    def query(self, sample_counts: Callable[[Any], Any]) -> None:
        a, source = self.args, self.source()
        current = read_json(self.project.embeddings / "current.json", "run db-build first")
        if current.get("embedder") != self.embedder.identity:
            raise GigatronError(
                f"--retro-bert-load {a.retro_bert_load}: the database was embedded with another "
                f"BERT ({current.get('embedder')}); query with that model, or run db-build again"
            )
        index, index_identity = open_index(self.project, a.retro_index_str, source)
        set_search_parameters(index, a.retro_query_nprobe, a.retro_query_ef_search)
        counts = sample_counts(self.cfg)
        datasets = get_family("gpt").build_datasets(self.cfg, self.tokenizer, counts, self.pctx)
        settings = QuerySettings(
            a.retro_query_num_neighbors_query, a.retro_query_num_neighbors_save, a.retro_block_size
        )
        database = ChunkDatabase(self.project)
        for split, dataset in zip(SPLIT_NAMES, datasets):
            if dataset is None:
                continue
            identity = {
                **source,
                "index": index_identity,
                "dataset_description": dataset.description,
                "nprobe": a.retro_query_nprobe,
                "ef_search": a.retro_query_ef_search,
                "num_neighbors_query": a.retro_query_num_neighbors_query,
            }
            if self.reusable(split, identity, settings):
                if self.pctx.rank == 0:
                    print(f"retro-preprocess: {split} neighbours reused", flush=True)
                continue
            chunks = SampleChunks(
                dataset, self.prefixes, self.cfg.model.seq_length, a.retro_gpt_chunk_length
            )
            query_split(
                self.project, split, chunks, self.embedder, lambda q, k: search(index, q, k),
                database, identity, settings, **self.ranks,
            )  # fmt: skip

    def reusable(self, split: str, identity: dict[str, Any], settings: QuerySettings) -> bool:
        path = self.project.query_meta(split)
        if not (path.is_file() and self.project.neighbors(split).is_file()):
            return False
        meta = read_json(path, "")
        same = all(meta.get(k) == v for k, v in identity.items())
        return same and meta.get("num_neighbors_save") == settings.num_neighbors_save


def run_tasks(
    args: argparse.Namespace, cfg: Any, tasks: list[str], sample_counts: Callable[[Any], Any]
) -> None:
    """Run `tasks` in this process (one rank of torchrun, or alone)."""
    apply_thread_choice()  # the command's edge: one thread choice for the process
    p = cfg.parallel
    pctx = ParallelContext.from_sizes(
        device=p.device,
        backend=p.distributed_backend,
        timeout_minutes=p.distributed_timeout_minutes,  # rank 0 alone trains the index
    )
    try:
        Pipeline(args, cfg, pctx).run(tasks, sample_counts)
    finally:
        destroy(pctx)
