"""Shared test fixtures: paths to the real data files in tests/data (sources and licenses in its
README.md; GIGATRON_SHARED_DATA may point elsewhere) and a preprocessed corpus. Shared helper
functions live in tests/helpers.py (importable as `helpers`: this file's folder is on sys.path)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import torch

from helpers import wordpiece_sentences

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GIGATRON_SHARED_DATA", REPO_ROOT / "tests" / "data"))

# Under pytest-xdist (`-n 2`, README's Tests section) on a 2-core machine: one torch thread per
# worker, so the two do not compete for the same cores (a lone pytest keeps two).
torch.set_num_threads(
    1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())
)

# What starts several processes at once (torchrun, run_distributed, a spawned group).
STARTS_PROCESSES = re.compile(
    r"run_distributed\(|gigatron_runs\(|nproc=|launcher\(|torch\.distributed\.run|"
    r"mp\.spawn|TCPStore"
)


@functools.cache
def starts_processes(test_file: str) -> bool:
    """Whether the tests of `test_file` (relative to the repository) start process groups."""
    path = REPO_ROOT / test_file
    return "distributed" in path.parts or bool(
        STARTS_PROCESSES.search(path.read_text(encoding="utf-8"))
    )


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n N` (pytest-xdist, README's Tests section): a file's tests stay on one
    worker (its module fixtures are made once), and the files that start process groups all run
    in turn on one worker, so two process groups never compete for the same cores while another
    worker runs the one-process files."""
    from xdist.scheduler import LoadScopeScheduling  # only under -n, where xdist is installed

    class ProcessGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            test_file = nodeid.split("::", 1)[0]
            return "process-groups" if starts_processes(test_file) else test_file

    return ProcessGroupScheduling(config, log)


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
