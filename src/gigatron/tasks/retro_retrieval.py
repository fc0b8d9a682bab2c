"""Retrieval while a Retro checkpoint generates (docs/retro.md 5.2).

Each complete chunk of the text (prompt and generated tokens, `--retro-gpt-chunk-length` each)
is embedded with the project's BERT embedder, exactly as its database chunks were, and the
project's index returns its `--retro-num-neighbors` nearest database chunks; each neighbour is
read with its continuation (`--retro-num-retrieved-chunks` chunks, eod-padded, as in training).
No own-document filter: the text is not in the database. A chunk is retrieved once, when it
completes, and kept (`ChunkRetriever` caches by content).

The engine runs `RetrievalStep` in place of the Retro model: the Retro model has no KV cache
(its chunked cross-attention needs the whole text), so every step is a full forward over each
sequence's tokens, padded to whole chunks. Position p sees the neighbours of chunk
(p - m + 1) // m, which is complete once the text reaches p, so the logits of every position
are those of the whole text. The tokens of each sequence live in the engine's cache (one
`TokenHistory` buffer pair), so the engine's slots, prefill, beam reordering and prompt
log-probs work unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gigatron.data.retro.index import open_index, search, set_search_parameters
from gigatron.data.retro.project import ProjectDir, read_json
from gigatron.data.retro.store import DB_FIX, ChunkDatabase
from gigatron.errors import GigatronError
from gigatron.inference.arguments import retrieval_flags_given
from gigatron.models.retro import RetroModel, RetroSpec
from gigatron.tasks.retro_embedder import BertChunkEmbedder, load_bert_embedder

MAX_CACHED_CHUNKS = 100_000  # retrieved chunks kept (a server's memory stays bounded)


class ChunkRetriever:
    """GPT token chunks -> int64 [n, k, r]: each chunk's k nearest database chunks, each with
    its continuation (r = chunk length x num_retrieved_chunks tokens)."""

    def __init__(
        self,
        embed: Any,
        index: Any,
        database: ChunkDatabase,
        num_neighbors: int,
        num_retrieved_chunks: int,
    ) -> None:
        self.embed, self.index, self.database = embed, index, database
        self.num_neighbors, self.num_retrieved_chunks = num_neighbors, num_retrieved_chunks
        self.found: dict[bytes, np.ndarray] = {}

    def neighbor_ids(self, chunks: list[np.ndarray]) -> np.ndarray:
        """int64 [n, k]: the database ids the index returns (-1 where it has fewer)."""
        return search(self.index, self.embed(chunks), self.num_neighbors)

    def __call__(self, chunks: list[np.ndarray]) -> np.ndarray:
        keys = [np.asarray(chunk, dtype=np.int64).tobytes() for chunk in chunks]
        todo = [key for key in dict.fromkeys(keys) if key not in self.found]
        if len(self.found) + len(todo) > MAX_CACHED_CHUNKS:
            self.found.clear()
        if todo:
            ids = self.neighbor_ids([np.frombuffer(key, dtype=np.int64) for key in todo])
            for key, row in zip(todo, ids):
                self.found[key] = np.stack(
                    [self.database.retrieved_tokens(int(i), self.num_retrieved_chunks) for i in row]
                )
        return np.stack([self.found[key] for key in keys])


class TokenHistory(nn.Module):
    """Keeps each cache slot's token ids in the engine's KV cache (a one-channel float64 buffer
    pair, exact for any vocabulary): what a step adds, and the whole text it reads back."""

    layer_number = 0  # the cache's key for this buffer pair (the Retro model's layers are not seen)

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.slot = nn.Parameter(torch.zeros(1, dtype=torch.float64, device=device), False)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (1, 1), (1, 1)

    def forward(self, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 [b, read] token ids of each step row's slot, int64 [b] its text length)."""
        fed = tokens.t()[:, :, None, None].to(torch.float64)
        history, _ = cache.update(self.layer_number, fed, fed)
        lengths = (~cache.attention_mask[:, 0]).any(dim=1).sum(-1)
        return history[:, :, 0, 0].t().long(), lengths


class RetrievalStep(nn.Module):
    """What the engine runs for a Retro checkpoint: (tokens [b, n], positions [b, n], cache) ->
    logits [b, n or 1, V/tp] like a GPT under a KV cache, from a full Retro forward over each
    sequence with the neighbours of its complete chunks."""

    def __init__(self, model: RetroModel, retriever: ChunkRetriever, eod: int) -> None:
        super().__init__()
        self.retro = (model,)  # a tuple: the KV cache sizes no buffers for its layers
        self.config = model.config
        self.spec: RetroSpec = model.spec
        self.retriever, self.eod = retriever, eod
        self.history = TokenHistory(next(model.parameters()).device)

    def neighbour_tokens(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """int64 [b, l, k, r]: the neighbours of each row's complete chunks, eod elsewhere."""
        m, spec = self.spec.chunk_length, self.spec
        rows, width = ids.shape
        shape = (rows, width // m, spec.num_neighbors, spec.retrieved_length)
        out = np.full(shape, self.eod, dtype=np.int64)
        text = ids.cpu().numpy()
        places = [(r, j) for r, length in enumerate(lengths) for j in range(length // m)]
        if places:
            found = self.retriever([text[r, j * m : (j + 1) * m] for r, j in places])
            for (r, j), neighbours in zip(places, found):
                out[r, j] = neighbours
        return torch.from_numpy(out).to(ids.device)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, inference_cache: Any
    ) -> torch.Tensor:
        history, lengths_t = self.history(tokens, inference_cache)
        lengths = lengths_t.tolist()
        m, rows = self.spec.chunk_length, tokens.shape[0]
        width = -(-max(lengths) // m) * m
        ids = torch.full((rows, width), self.eod, dtype=torch.long, device=tokens.device)
        keep = min(width, history.shape[1])
        ids[:, :keep] = history[:, :keep]
        ids[torch.arange(width, device=ids.device)[None, :] >= lengths_t[:, None]] = self.eod
        position_ids = torch.arange(width, device=ids.device).expand(rows, width)
        (model,) = self.retro
        logits = model(ids, position_ids, None, self.neighbour_tokens(ids, lengths))
        fed = logits[torch.arange(rows, device=ids.device)[:, None], positions.clamp(max=width - 1)]
        return inference_cache.select_hidden(fed.transpose(0, 1)).transpose(0, 1)


def only_index(project: ProjectDir) -> str:
    """The index string of the project's one filled index."""
    folder = project.root / "index"
    filled = sorted(p / "added.json" for p in folder.glob("*") if (p / "added.json").is_file())
    if len(filled) != 1:
        names = [str(read_json(p, "").get("index_str")) for p in filled]
        found = f"indexes {', '.join(names)}" if names else "no filled index"
        raise GigatronError(
            f"--retro-project-dir {project.root}: {found}; "
            + ("give --retro-index-str" if names else "run `gigatron retro-preprocess "
               "--retro-tasks index-build` first")
        )  # fmt: skip
    return str(read_json(filled[0], "")["index_str"])


def project_embedder(
    project: ProjectDir, current: dict[str, Any], pctx: Any, tokenizer: Any
) -> Any:
    """The BERT embedder the project's database was embedded with (its checkpoint must still
    be where db-build read it)."""
    recorded = current.get("embedder") or {}
    load = str(recorded.get("load"))
    where = project.embeddings / "current.json"
    if not Path(load).is_dir():
        raise GigatronError(
            f"{where}: the BERT checkpoint {load} that embedded the database is gone; put it "
            "back there (queries must be embedded by the same model)"
        )
    vocab = recorded.get("vocab")
    flags = {
        "tokenizer_type": recorded.get("tokenizer"),
        "vocab_file": None if vocab in (None, "None") else vocab,
    }
    embedder: BertChunkEmbedder = load_bert_embedder(
        load, pctx, tokenizer, int(recorded["max_length"]), 64, flags
    )
    if embedder.identity != recorded:
        raise GigatronError(
            f"{where}: the database was embedded with {recorded}, the checkpoint there is now "
            f"{embedder.identity}; run retro-preprocess --retro-tasks db-build again"
        )
    return embedder


def project_database(args: argparse.Namespace) -> tuple[ProjectDir, ChunkDatabase]:
    """`--retro-project-dir` and its chunk database."""
    project = ProjectDir(args.retro_project_dir)
    read_json(project.config, "give the directory `gigatron retro-preprocess` wrote")
    return project, ChunkDatabase(project)


def project_retriever(
    args: argparse.Namespace,
    project: ProjectDir,
    database: ChunkDatabase,
    pctx: Any,
    tokenizer: Any,
    counts: tuple[int, int],
) -> ChunkRetriever:
    """The retriever of a project's `database`: its embeddings' BERT, its index (--retro-index-str,
    else its one filled index, searched with --retro-query-nprobe/-ef-search); `counts` is
    (neighbours per chunk, chunks per neighbour)."""
    current = read_json(project.embeddings / "current.json", DB_FIX)
    if current.get("db_identity") != database.identity:
        raise GigatronError(
            f"{project.embeddings / 'current.json'}: embeddings of another chunk database; "
            "run --retro-tasks db-build again"
        )
    source = {"db_identity": database.identity, "embeddings": current["key"]}
    index, _ = open_index(project, args.retro_index_str or only_index(project), source)
    set_search_parameters(index, args.retro_query_nprobe, args.retro_query_ef_search)
    embedder = project_embedder(project, current, pctx, tokenizer)
    return ChunkRetriever(embedder, index, database, *counts)


def open_retriever(args: argparse.Namespace, loaded: Any, spec: RetroSpec) -> ChunkRetriever:
    """The retriever of `--retro-project-dir` for a Retro model of `spec`."""
    project, database = project_database(args)
    if database.chunk_length != spec.chunk_length or database.eod != loaded.tokenizer.eod:
        raise GigatronError(
            f"--retro-project-dir {project.root}: chunks of {database.chunk_length} "
            f"tokens with eod {database.eod}, the checkpoint has --retro-gpt-chunk-length "
            f"{spec.chunk_length} and eod {loaded.tokenizer.eod}; give the project it was "
            "trained with"
        )
    counts = (spec.num_neighbors, spec.num_retrieved_chunks)
    return project_retriever(args, project, database, loaded.pctx, loaded.tokenizer, counts)


def check_run(loaded: Any, args: argparse.Namespace, spec: RetroSpec) -> None:
    """What generation with retrieval does not do (yet), refused before anything is built."""
    k = getattr(args, "retro_num_neighbors", None)
    if k is not None and k != spec.num_neighbors:
        raise GigatronError(
            f"--retro-num-neighbors {k}: the checkpoint's neighbour encoder was built for "
            f"{spec.num_neighbors}; give {spec.num_neighbors} or leave the flag out"
        )
    refused = {
        "more than one process (retrieval runs in one; convert the checkpoint to tensor- and "
        "pipeline-parallel 1)": loaded.pctx.world_size > 1,
        "--inference-dynamic-batching": bool(getattr(args, "inference_dynamic_batching", False)),
        "--num-speculative-tokens": bool(getattr(args, "num_speculative_tokens", 0)),
    }
    given = [what for what, asked in refused.items() if asked]
    if given:
        raise GigatronError(
            f"{'; '.join(given)}: not available when a Retro checkpoint generates with retrieval"
        )
    config, m = loaded.chunks[0].config, spec.chunk_length
    # the engine's length: generate and serve's --max-sequence-length, evaluate's --seq-length,
    # else the model's positions
    flag = "--max-sequence-length" if hasattr(args, "max_sequence_length") else "--seq-length"
    limit = getattr(args, flag[2:].replace("-", "_"), None)
    if limit is None:
        flag, limit = "--max-position-embeddings", config.max_position_embeddings
    if config.position_embedding_type == "learned_absolute" and limit and limit % m:
        raise GigatronError(
            f"{flag} {limit}: a Retro model with learned positions reads whole chunks; give "
            f"--max-sequence-length (evaluate: --seq-length), a multiple of "
            f"--retro-gpt-chunk-length {m}"
        )


def attach_retrieval(loaded: Any, args: argparse.Namespace) -> None:
    """generate/serve's attach hook: a Retro checkpoint runs as `RetrievalStep`; for other
    checkpoints the retrieval flags are refused."""
    model = loaded.chunks[0]
    if not isinstance(model, RetroModel):
        given = retrieval_flags_given(args)
        if given:
            raise GigatronError(
                f"{', '.join(given)}: the --load checkpoint is not a Retro model (retrieval is "
                "for `gigatron pretrain retro` checkpoints); drop the flag(s)"
            )
        return
    check_run(loaded, args, model.spec)
    retriever = open_retriever(args, loaded, model.spec)
    loaded.chunks = [RetrievalStep(model, retriever, loaded.tokenizer.eod)]
