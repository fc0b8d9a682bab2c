"""InstructRetro's instruction tuning data (`gigatron pretrain retro --sft`): gigatron's SFT
conversations (data/sft_dataset.py: JSON lines, a weighted blend of files, the loss on the
response tokens only), each sample with the neighbour tokens [l, k, r] the Retro model reads.

A line's neighbours are the passages it lists under `"neighbours"` (texts, e.g. retrieved for
its prompt from a Retro project by `retro-preprocess --retro-tasks query-sft`): the first
--retro-num-neighbors of them, each tokenized with the GPT tokenizer, cut to r = chunk length
x --retro-num-retrieved-chunks tokens and padded with eod (as a short database chunk is),
serve as the neighbours of every chunk of the sample. A line without the field gets Megatron's
SFT fallback (tools/retro/sft, RetroJsonQADataset): neighbour tokens of id 0, its encoder input
carrying nothing; the context goes in the prompt instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gigatron.data.builder import build_datasets
from gigatron.data.json_lines import json_lines
from gigatron.data.sft_dataset import SFTConversations, SFTDataset
from gigatron.errors import GigatronError

FIELD = "neighbours"


def neighbour_shape(cfg: Any) -> tuple[int, int, int]:
    """(l chunks per sample, k neighbours per chunk, r tokens per neighbour)."""
    r = cfg.retro
    chunk = r.retro_gpt_chunk_length
    return (
        cfg.model.seq_length // chunk,
        r.retro_num_neighbors,
        chunk * r.retro_num_retrieved_chunks,
    )


def line_neighbours(record: Any, tokenizer: Any, k: int, r: int, where: str) -> np.ndarray | None:
    """The [k, r] neighbour tokens of one JSON line, None when it gives none (the fallback)."""
    texts = record.get(FIELD) if isinstance(record, dict) else None
    if texts is None:
        return None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise GigatronError(f'{where}: "{FIELD}" must be a list of texts (the retrieved passages)')
    if len(texts) < k:
        raise GigatronError(
            f'{where}: {len(texts)} "{FIELD}" for --retro-num-neighbors {k}; give at least {k} '
            f'passages, or leave "{FIELD}" out for Megatron\'s empty neighbours'
        )
    out = np.full((k, r), tokenizer.eod, dtype=np.int64)
    for row, text in enumerate(texts[:k]):
        ids = list(tokenizer.tokenize(text))[:r]
        out[row, : len(ids)] = ids
    return out


class RetroSFTConversations(SFTConversations):
    """A file's conversations (read by SFTDataset) and each line's neighbour tokens [l, k, r]."""

    def __init__(self, base: SFTConversations, tokenizer: Any, shape: tuple[int, int, int]):
        self.path, self.conversations, self.shape = base.path, base.conversations, shape
        _, k, r = shape
        self.neighbours: list[np.ndarray | None] = []
        with open(base.path, encoding="utf-8") as handle:
            for number, record in json_lines(handle, base.path):
                where = f"{base.path}: line {number}"
                self.neighbours.append(line_neighbours(record, tokenizer, k, r, where))

    def neighbour_tokens(self, conversation: int) -> np.ndarray:
        found = self.neighbours[conversation]
        if found is None:  # Megatron's SFT fallback: token id 0 everywhere
            return np.zeros(self.shape, dtype=np.int64)
        return np.ascontiguousarray(np.broadcast_to(found, self.shape))


class RetroSFTDataset(SFTDataset):
    """One split of one instruction file: SFTDataset's samples plus `neighbour_tokens`."""

    cache_name = "RetroSFTDataset"

    def __init__(self, low_level: RetroSFTConversations, *args: Any, **kwargs: Any) -> None:
        super().__init__(low_level, *args, **kwargs)
        self.unique_identifiers["neighbour_shape"] = list(low_level.shape)

    @staticmethod
    def open_low_level(path: str, flag: str, cfg: Any, tokenizer: Any) -> RetroSFTConversations:
        base = SFTDataset.open_low_level(path, flag, cfg, tokenizer)
        return RetroSFTConversations(base, tokenizer, neighbour_shape(cfg))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = super().__getitem__(index)
        tokens = self.dataset.neighbour_tokens(self.conversation_index(index))
        return {**sample, "neighbour_tokens": tokens}


def build_retro_sft_datasets(cfg: Any, tokenizer: Any, num_samples, pctx: Any = None):
    """(train, valid, test) instruction datasets with neighbours (`--sft --data-path ...`)."""
    return build_datasets(RetroSFTDataset, cfg, tokenizer, num_samples, pctx)
