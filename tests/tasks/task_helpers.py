"""Shared by the task tests: tiny GPT checkpoints with the GPT-2 tokenizer (untrained, or trained
to memorise a few LAMBADA passages), and the model they hold, in this process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from gigatron.checkpoint.torch_format import save_checkpoint
from gigatron.data.tokenizers import build_tokenizer
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.tasks.lambada import passage_sample, split_passage
from gigatron.tasks.wikitext import wikitext_detokenize
from gigatron.training.pretrain import parse_pretrain_config
from helpers import DATA, LAMBADA

WIKITEXT = DATA / "wikitext-2-wiki.test.tokens"
SEQ = 96


def model_flags(seq_length: int = SEQ) -> list[str]:
    return [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(DATA / "gpt2-vocab.json"), "--merge-file", str(DATA / "gpt2-merges.txt"),
        "--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--position-embedding-type",
        "rope", "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--init-method-std", "0.2", "--seed", "5",
        # One padded vocabulary at every tp size: padded logits join the softmax (as in Megatron).
        "--padded-vocab-size", "50304",
    ]  # fmt: skip


def tiny_model(seq_length: int = SEQ):
    cfg = parse_pretrain_config(model_flags(seq_length), world_size=1)
    tokenizer = build_tokenizer(cfg.tokenizer)
    (chunk,) = build_model(cfg, ParallelContext.single(), vocab_size=tokenizer.vocab_size)
    return cfg, tokenizer, chunk


def save(directory: Path, cfg, chunk) -> None:
    save_checkpoint(
        directory, 1, [chunk], None, None, ParallelContext.single(), cfg,
        extra={"gigatron_family": "gpt"},
    )  # fmt: skip


def lambada_texts(count: int, skip: int = 0) -> list[str]:
    with open(LAMBADA, encoding="utf-8") as handle:
        lines = handle.readlines()[skip : skip + count]
    return [json.loads(line)["text"] for line in lines]


def memorise(chunk, tokenizer, texts: list[str], seq_length: int, steps: int = 200) -> None:
    """Train `chunk` until it predicts each passage's last word (strict and non-strict targets)
    greedily from its context."""
    samples = [
        passage_sample(*split_passage(text, tokenizer, strict), seq_length)
        for text in texts
        for strict in (False, True)
    ]
    tokens = torch.zeros(len(samples), seq_length + 1, dtype=torch.long)
    mask = torch.zeros(len(samples), seq_length)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample.tokens)] = torch.from_numpy(sample.tokens)
        mask[row, : len(sample.loss_mask)] = torch.from_numpy(sample.loss_mask)
    optimizer = torch.optim.Adam(chunk.parameters(), lr=1e-2)
    chunk.train()
    pctx = ParallelContext.single()
    for _ in range(steps):
        logits = chunk(tokens[:, :-1], None)
        loss = (token_losses(logits, tokens[:, 1:], pctx) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.02:
            break
    chunk.eval()


def window_perplexity(model, tokenizer, text: str) -> float:
    """Perplexity of a one-chunk model over the detokenized WikiText `text`, in windows of SEQ."""
    tokens = torch.tensor(tokenizer.tokenize(wikitext_detokenize(text)))
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, SEQ):
            window = tokens[start : start + SEQ + 1]
            logits = model(window[None, :-1], None)[0].float()
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
    return math.exp(total / (len(tokens) - 1))
