"""Shared test fixtures: paths to the real data files in tests/data (sources and licenses in its
README.md; GIGATRON_SHARED_DATA may point elsewhere) and a preprocessed corpus. Shared helper
functions live in tests/helpers.py (importable as `helpers`: this file's folder is on sys.path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import wordpiece_sentences

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GIGATRON_SHARED_DATA", REPO_ROOT / "tests" / "data"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data directory {SHARED_DATA} is missing (set GIGATRON_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def wordpiece_corpus(tmp_path_factory) -> str:
    """300 LAMBADA passages, sentence-split and WordPiece-tokenised (the BERT and T5 runs'
    --data-path), preprocessed once for the session."""
    return wordpiece_sentences(tmp_path_factory.mktemp("wordpiece-data"))


@pytest.fixture(scope="session")
def gpt2_tokenizer(shared_data):
    """The GPT-2 BPE tokenizer of tests/data's vocabulary and merges."""
    from gigatron.config.tokenizer import TokenizerConfig
    from gigatron.data.tokenizers import build_tokenizer

    return build_tokenizer(
        TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(shared_data / "gpt2-vocab.json"),
            merge_file=str(shared_data / "gpt2-merges.txt"),
        )
    )
