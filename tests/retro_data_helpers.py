"""A small real corpus for the Retro data tests: WikiText-2 paragraphs as GPT-2 documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gigatron.config import GigatronConfig
from gigatron.data.indexed import write_dataset
from gigatron.data.retro.database import build_database
from gigatron.data.retro.project import ProjectDir, write_json
from gigatron.data.retro.store import ChunkDatabase
from gigatron.data.tokenizers import GPT2BPETokenizer
from helpers import DATA

WIKITEXT = DATA / "wikitext-2-wiki.test.tokens"
GPT_FILES = (str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))


def gpt_tokenizer() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(*GPT_FILES)


def wikitext_paragraphs(count: int, skip: int = 0) -> list[str]:
    """The first `count` paragraphs (non-heading lines) of WikiText-2's test split."""
    lines = WIKITEXT.read_text(encoding="utf-8").splitlines()
    paragraphs = [line.strip() for line in lines if line.strip() and not line.startswith(" =")]
    return paragraphs[skip : skip + count]


def write_corpus(directory: Path, count: int, name: str = "wiki", skip: int = 0) -> str:
    """A .bin/.idx dataset of `count` paragraphs (each ending with eod); returns its prefix."""
    tokenizer = gpt_tokenizer()
    docs = [[tokenizer.tokenize(p) + [tokenizer.eod]] for p in wikitext_paragraphs(count, skip)]
    prefix = str(directory / f"{name}_text_document")
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def gpt_config(prefix: str, seq_length: int, split: str = "90,10,0", seed: int = 1234):
    cfg = GigatronConfig()
    cfg.model.seq_length = seq_length
    cfg.training.seed = seed
    cfg.data.data_path = [prefix]
    cfg.data.split = split
    cfg.data.data_cache_path = str(Path(prefix).parent / "cache")
    return cfg


def bag_of_tokens(chunks: list[np.ndarray], dim: int = 64) -> np.ndarray:
    """A cheap deterministic embedding: normalised token counts hashed into `dim` bins."""
    out = np.zeros((len(chunks), dim), dtype=np.float32)
    for row, tokens in enumerate(chunks):
        out[row] = np.bincount(np.asarray(tokens) % dim, minlength=dim)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-6)


def brute_force(database: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k nearest database rows of each query by exact squared L2 distance."""
    distances = ((queries[:, None, :] - database[None, :, :]) ** 2).sum(-1)
    return np.argsort(distances, axis=1, kind="stable")[:, :k]


def tiny_database(root: Path, seq_length: int, chunk_length: int, doc_block_size: int):
    """(corpus prefix, tokenizer, project, database, bag-of-tokens embeddings of its chunks): a
    Retro project over 40 WikiText-2 paragraphs, its chunk database built."""
    prefix = write_corpus(root, 40)
    tokenizer = gpt_tokenizer()
    project = ProjectDir(root / "project")
    write_json(project.config, {"seq_length": seq_length})
    build_database(
        project, [prefix], chunk_length, tokenizer.eod, tokenizer.detokenize,
        lambda text: len(text.split()), doc_block_size=doc_block_size,
    )  # fmt: skip
    database = ChunkDatabase(project)
    embeddings = bag_of_tokens([database.tokens(i) for i in range(len(database))])
    return prefix, tokenizer, project, database, embeddings
