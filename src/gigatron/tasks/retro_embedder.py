"""Retro's chunk embedder: a BERT encoder's mean hidden state of each GPT chunk's text.

As Megatron's retro preprocessing (tools/bert_embedding, `--bert-embedder-type megatron` with
`output_bert_embeddings`): the GPT tokens are detokenized, the eod text is removed, the text is
WordPiece-tokenized and cut to --retro-bert-max-chunk-length - 2 tokens ([PAD] alone when
nothing is left), framed as [CLS] ... [SEP], and the embedding is the mean of the encoder's
output (after its final norm) over the positions between [CLS] and [SEP].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gigatron.checkpoint.formats import load_checkpoint, saved_header
from gigatron.checkpoint.torch_format import locate_iteration
from gigatron.config import config_from_dict
from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError
from gigatron.models.bert import build_bert_model
from gigatron.parallel.context import ParallelContext


class BertChunkEmbedder:
    """Embeds GPT token chunks (float32 [n, hidden]); `identity` names the model it uses."""

    def __init__(
        self,
        model: Any,
        bert_tokenizer: Any,
        detokenize: Callable[[list[int]], str],
        eod_text: str,
        max_length: int,
        batch_size: int,
        identity: dict[str, Any],
    ) -> None:
        self.model, self.bert = model, bert_tokenizer
        self.detokenize, self.eod_text = detokenize, eod_text
        self.max_length, self.batch_size = max_length, batch_size
        self.identity = identity

    def text(self, chunk: np.ndarray) -> str:
        text = self.detokenize([int(t) for t in chunk])
        return text.replace(self.eod_text, "") if self.eod_text else text

    def bert_length(self, text: str) -> int:
        """WordPiece tokens of `text` (0: the chunk is left out of the database)."""
        return len(self.bert.tokenize(text))

    def token_ids(self, chunk: np.ndarray) -> list[int]:
        ids = self.bert.tokenize(self.text(chunk))[: self.max_length - 2] or [self.bert.pad]
        return [self.bert.cls, *ids, self.bert.sep]

    @torch.no_grad()
    def __call__(self, chunks: list[np.ndarray]) -> np.ndarray:
        out = [
            self.embed_batch(chunks[i : i + self.batch_size])
            for i in range(0, len(chunks), self.batch_size)
        ]
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    def embed_batch(self, chunks: list[np.ndarray]) -> np.ndarray:
        rows = [self.token_ids(chunk) for chunk in chunks]
        lengths = torch.tensor([len(r) for r in rows])
        width = int(lengths.max())
        tokens = torch.full((len(rows), width), self.bert.pad, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        positions = torch.arange(width).expand(len(rows), width)
        padded = positions >= lengths[:, None]  # True = masked key
        device = next(self.model.parameters()).device
        hidden = self.model.encode(
            tokens.to(device), positions.to(device), padded[:, None, None, :].to(device),
            torch.zeros_like(tokens).to(device),
        )  # fmt: skip
        hidden = hidden.transpose(0, 1).float()  # [b, s, h]
        inner = (positions >= 1) & (positions < lengths[:, None] - 1)  # between [CLS] and [SEP]
        weights = inner.to(device, hidden.dtype)[:, :, None]
        return (hidden * weights).sum(1).div(weights.sum(1)).cpu().numpy().astype(np.float32)


def load_bert_embedder(
    load_dir: str,
    pctx: ParallelContext,
    gpt_tokenizer: Any,
    max_length: int,
    batch_size: int,
    bert_tokenizer_flags: dict[str, Any],
) -> BertChunkEmbedder:
    """The embedder of the gigatron BERT checkpoint in `load_dir` (each rank a whole copy)."""
    located = locate_iteration(Path(load_dir)) if Path(load_dir).is_dir() else None
    if located is None:
        raise GigatronError(
            f"--retro-bert-load {load_dir}: no checkpoint there; give a directory written by "
            "`gigatron pretrain bert --save` or `gigatron convert` of a Hugging Face BERT"
        )
    iteration_dir, iteration, _ = located
    header = saved_header(iteration_dir)
    if header.get("gigatron_family") != "bert" or not isinstance(header.get("args"), dict):
        raise GigatronError(
            f"--retro-bert-load {load_dir}: not a gigatron BERT checkpoint (family "
            f"{header.get('gigatron_family')!r}); give a BERT checkpoint"
        )
    cfg = config_from_dict(header["args"], source=f"{iteration_dir} args")
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.sequence_parallel = False
    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_load_rng = True
    overrides = {k: v for k, v in bert_tokenizer_flags.items() if v is not None}
    tokenizer_cfg = dataclasses.replace(cfg.tokenizer, **overrides)
    if tokenizer_cfg.tokenizer_type is None:  # e.g. converted from Hugging Face
        raise GigatronError(
            f"--retro-bert-load {load_dir}: the checkpoint names no tokenizer; give "
            f"--retro-bert-tokenizer-type BertWordPieceLowerCase --retro-bert-vocab-file "
            f"{Path(load_dir) / 'vocab.txt'} (the vocabulary `gigatron convert` copied there)"
        )
    bert_tokenizer = build_tokenizer(tokenizer_cfg)
    model = build_bert_model(cfg, pctx, vocab_size=bert_tokenizer.vocab_size)[0]
    load_checkpoint(load_dir, [model], None, None, pctx, cfg)
    model.eval()
    eod = getattr(gpt_tokenizer, "eod", None)
    identity = {"load": str(Path(load_dir).resolve()), "iteration": iteration,
                "max_length": max_length, "tokenizer": tokenizer_cfg.tokenizer_type,
                "vocab": str(tokenizer_cfg.vocab_file)}  # fmt: skip
    eod_text = gpt_tokenizer.detokenize([eod]) if eod is not None else ""
    return BertChunkEmbedder(
        model, bert_tokenizer, gpt_tokenizer.detokenize, eod_text, max_length, batch_size, identity
    )
