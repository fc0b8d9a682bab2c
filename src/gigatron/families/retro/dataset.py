"""The Retro datasets: sample i of a split = the GPT dataset's sample i (`pretrain gpt`'s same
--data-path, --split, --seed, --seq-length) + the neighbour tokens the Retro project saved for
it (`RetroNeighbourStore`, --retro-project-dir), or with --mock-data random neighbours."""

from __future__ import annotations

from typing import Any

import numpy as np

from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.retro.store import RetroNeighbourStore
from gigatron.errors import GigatronError
from gigatron.families.retro.sft import build_retro_sft_datasets

SPLITS = ("train", "valid", "test")


class RetroDataset:
    """A GPT split dataset with each sample's `neighbour_tokens` [l, k, r] (int64)."""

    def __init__(self, gpt: Any, neighbours: Any) -> None:
        self.gpt = gpt
        self.neighbours = neighbours

    def __len__(self) -> int:
        return len(self.gpt)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {**self.gpt[index], "neighbour_tokens": self.neighbours.neighbour_tokens(index)}


class MockNeighbours:
    """--mock-data: random neighbour tokens, the same for sample i in every run and rank."""

    def __init__(self, shape: tuple[int, int, int], vocab_size: int, seed: int) -> None:
        self.shape, self.vocab_size, self.seed = shape, vocab_size, seed

    def neighbour_tokens(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, self.vocab_size, self.shape, dtype=np.int64)


def neighbour_source(cfg, tokenizer, split: str, gpt: Any) -> Any:
    """The store of `split` checked against `gpt` (or mock neighbours under --mock-data)."""
    r = cfg.retro
    chunks = cfg.model.seq_length // r.retro_gpt_chunk_length
    if r.retro_project_dir is None:
        shape = (
            chunks,
            r.retro_num_neighbors,
            r.retro_gpt_chunk_length * r.retro_num_retrieved_chunks,
        )
        return MockNeighbours(shape, tokenizer.vocab_size, cfg.training.seed + SPLITS.index(split))
    store = RetroNeighbourStore.open(
        r.retro_project_dir,
        split,
        r.retro_num_neighbors,
        r.retro_num_retrieved_chunks,
        seq_length=cfg.model.seq_length,
        chunk_length=r.retro_gpt_chunk_length,
    )
    store.check_dataset(gpt)
    return store


def check_neighbour_source(cfg) -> None:
    """Where a run's neighbours come from (a run's rule, not a checkpoint's: a converted
    checkpoint is read without its data flags)."""
    r = cfg.retro
    if cfg.data.sft and r.retro_project_dir is not None:
        raise GigatronError(
            f"--retro-project-dir {r.retro_project_dir} with --sft: instruction data are not "
            'queried while training; fill each JSON line\'s "neighbours" from the project first '
            "(`gigatron retro-preprocess --retro-tasks query-sft`, docs/retro.md 5.1) and drop "
            "--retro-project-dir"
        )
    if r.retro_project_dir is None and not cfg.data.mock_data and not cfg.data.sft:
        raise GigatronError(
            "pretrain retro: no --retro-project-dir; give the directory `gigatron "
            "retro-preprocess` wrote (docs/retro.md), or --mock-data for random neighbours"
        )


def build_retro_datasets(cfg, tokenizer, num_samples, pctx=None) -> tuple[Any, Any, Any]:
    """(train, valid, test) Retro datasets; None where the GPT split is None or no samples are
    asked of it (a run without evaluation needs no valid and test neighbours)."""
    check_neighbour_source(cfg)
    if cfg.data.sft:  # instruction tuning: docs/retro.md 5.1
        return build_retro_sft_datasets(cfg, tokenizer, num_samples, pctx)
    gpt_splits = build_gpt_datasets(cfg, tokenizer, num_samples, pctx)
    return tuple(
        None
        if gpt is None or count is None
        else RetroDataset(gpt, neighbour_source(cfg, tokenizer, split, gpt))
        for split, gpt, count in zip(SPLITS, gpt_splits, num_samples, strict=True)
    )  # type: ignore[return-value]
