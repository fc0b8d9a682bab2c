"""Shared by the Retro generation and QA tests: a Retro project over 20 WikiText-2 paragraphs (a
tiny random BERT embedder, a Flat index), a tiny untrained Retro checkpoint with the GPT-2
tokenizer (its weights large enough that neighbours move the logits), and the reference
generation loop: neighbours found by brute force over the saved embeddings, one full forward
per token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gigatron.checkpoint.formats import save_checkpoint
from gigatron.data.retro.embeddings import embeddings_dir, load_embeddings
from gigatron.data.retro.project import ProjectDir, read_json
from gigatron.data.retro.store import ChunkDatabase
from gigatron.data.tokenizers import build_tokenizer
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext
from gigatron.tasks.retro_embedder import load_bert_embedder
from gigatron.tasks.retro_preprocess import main as retro_preprocess
from gigatron.training.pretrain import parse_pretrain_config
from helpers import BERT_VOCAB
from retro_data_helpers import GPT_FILES, gpt_tokenizer, write_corpus

SEQ, CHUNK, NEIGHBOURS = 32, 8, 2  # the project's sample length, its chunks
CONTEXT = 128  # the model's: a QA prompt fits
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT_FILES[0],
        "--merge-file", GPT_FILES[1]]  # fmt: skip
RETRO = [
    *GPT2, "--mock-data", "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads",
    "4", "--seq-length", str(CONTEXT), "--max-position-embeddings", str(CONTEXT),
    "--retro-gpt-chunk-length", str(CHUNK), "--retro-num-neighbors", str(NEIGHBOURS),
    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--retro-encoder-hidden-dropout", "0",
    "--retro-encoder-attention-dropout", "0", "--init-method-std", "0.3", "--seed", "7",
]  # fmt: skip
BERT = [
    "--mock-data", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(BERT_VOCAB),
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
    "64", "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size",
    "2", "--train-iters", "1", "--lr", "1e-4",
]  # fmt: skip


def save_untrained(directory: Path, family: str, flags: list[str]) -> None:
    """A freshly initialised model of `family` saved as a training checkpoint (iteration 1)."""
    cfg = parse_pretrain_config(flags, world_size=1, family=family)
    pctx = ParallelContext.single()
    tokenizer = build_tokenizer(cfg.tokenizer)
    chunks = get_family(family).build_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
    save_checkpoint(directory, 1, chunks, None, None, pctx, cfg, extra={"gigatron_family": family})


@dataclass
class RetroSetup:
    root: Path
    project: Path
    checkpoint: Path
    bert: Path

    def flags(self, *extra: str) -> list[str]:
        """The generate/serve/evaluate flags of this checkpoint and project."""
        return ["--load", str(self.checkpoint), "--device", "cpu",
                "--retro-project-dir", str(self.project), *extra]  # fmt: skip


def build_setup(root: Path) -> RetroSetup:
    prefix = write_corpus(root, 20)
    bert, checkpoint, project = root / "bert", root / "retro", root / "project"
    save_untrained(bert, "bert", BERT)
    save_untrained(checkpoint, "retro", RETRO)
    retro_preprocess([
        "--retro-project-dir", str(project), "--retro-tasks", "db-build,index-train,index-add",
        "--retro-bert-load", str(bert), "--retro-bert-max-chunk-length", "64",
        "--retro-index-str", "Flat", "--retro-index-ntrain", "100", "--retro-block-size", "64",
        "--data-path", prefix, "--split", "100,0,0", "--seq-length", str(SEQ),
        "--retro-gpt-chunk-length", str(CHUNK), *GPT2, "--train-samples", "8",
        "--global-batch-size", "4", "--eval-iters", "0",
    ])  # fmt: skip
    return RetroSetup(root, project, checkpoint, bert)


class ReferenceRetro:
    """The Retro checkpoint with neighbours assembled by hand: each complete chunk embedded by
    the project's BERT, its nearest database chunks by brute force (exact squared L2 over the
    saved embeddings), each followed by the next database chunk, eod-padded."""

    def __init__(self, setup: RetroSetup, model: torch.nn.Module) -> None:
        project = ProjectDir(setup.project)
        self.model, self.database = model, ChunkDatabase(project)
        current = read_json(project.embeddings / "current.json", "")
        directory = embeddings_dir(project, current["key"])
        self.embeddings = load_embeddings(directory, len(self.database), current["block_size"])
        self.embedder = load_bert_embedder(
            str(setup.bert), ParallelContext.single(), gpt_tokenizer(), 64, 16, {}
        )
        self.eod = gpt_tokenizer().eod
        self.found: dict[tuple[int, ...], np.ndarray] = {}

    def neighbours(self, chunk: list[int]) -> np.ndarray:
        key = tuple(chunk)
        if key not in self.found:
            self.found[key] = self.search(chunk)
        return self.found[key]

    def search(self, chunk: list[int]) -> np.ndarray:
        query = self.embedder([np.asarray(chunk)])
        distances = ((self.embeddings - query) ** 2).sum(-1)
        ids = np.argsort(distances, kind="stable")[:NEIGHBOURS]
        total = len(self.database)
        return np.stack(
            [np.concatenate([self.database.tokens(i), self.database.tokens((i + 1) % total)])
             for i in ids]
        )  # fmt: skip

    def logits(self, tokens: list[int], empty: bool = False) -> torch.Tensor:
        """float [len(tokens), padded vocab] of one sequence; `empty`: all-eod neighbours."""
        width = -(-len(tokens) // CHUNK) * CHUNK
        ids = torch.full((1, width), self.eod, dtype=torch.long)
        ids[0, : len(tokens)] = torch.tensor(tokens)
        nb = np.full((1, width // CHUNK, NEIGHBOURS, 2 * CHUNK), self.eod, dtype=np.int64)
        for j in range(0 if empty else len(tokens) // CHUNK):
            nb[0, j] = self.neighbours(tokens[j * CHUNK : (j + 1) * CHUNK])
        positions = torch.arange(width)[None]
        with torch.no_grad():
            out = self.model(ids, positions, None, torch.from_numpy(nb))
        return out[0, : len(tokens)].float()

    def greedy(self, prompt: list[int], steps: int, vocab: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(steps):
            token = int(self.logits(tokens)[-1, :vocab].argmax())
            if token == self.eod:
                break
            tokens.append(token)
        return tokens[len(prompt) :]
