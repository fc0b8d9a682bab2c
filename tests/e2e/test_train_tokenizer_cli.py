"""`gigatron train-tokenizer` writes files that build_tokenizer reads with the printed flags."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

import helpers
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.tokenizers import build_tokenizer


def gigatron(*args: str) -> subprocess.CompletedProcess:
    return helpers.gigatron(*args, check=False, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data):
    path = tmp_path_factory.mktemp("corpus") / "lambada.jsonl"
    lines = (shared_data / "lambada_test.jsonl").read_text().splitlines()[:400]
    path.write_text("\n".join(lines) + "\n")
    return path


def flags_from(stdout: str) -> TokenizerConfig:
    line = next(x for x in stdout.splitlines() if x.startswith("use it with: "))
    words = shlex.split(line[len("use it with: ") :])
    values = dict(zip(words[::2], words[1::2]))
    return TokenizerConfig(
        tokenizer_type=values["--tokenizer-type"],
        vocab_file=values["--vocab-file"],
        merge_file=values.get("--merge-file"),
    )


def _train(corpus, tokenizer_type: str, vocab_size: int, output_dir):
    return gigatron(
        "train-tokenizer", "--input", str(corpus), "--tokenizer-type", tokenizer_type,
        "--vocab-size", str(vocab_size), "--output-dir", str(output_dir),
    )  # fmt: skip


def test_byte_level_bpe(tmp_path, corpus):
    out = tmp_path / "bpe"
    result = _train(corpus, "GPT2BPETokenizer", 600, out)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(out)) == ["merges.txt", "vocab.json"]
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab) == 600
    assert vocab["<|endoftext|>"] == 0
    tokenizer = build_tokenizer(flags_from(result.stdout))
    assert tokenizer.vocab_size == 600 and tokenizer.eod == 0
    text = "The man looked at her and said nothing."
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    # Trained merges compress frequent words: far fewer tokens than bytes.
    assert len(ids) < len(text) / 2
    assert max(ids) < 600


def test_wordpiece(tmp_path, corpus):
    out = tmp_path / "wp"
    result = _train(corpus, "BertWordPieceLowerCase", 800, out)
    assert result.returncode == 0, result.stderr
    lines = (out / "vocab.txt").read_text().splitlines()
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(lines) == 800
    tokenizer = build_tokenizer(flags_from(result.stdout))
    assert (tokenizer.pad, tokenizer.unk, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (
        0,
        1,
        2,
        3,
        4,
    )
    ids = tokenizer.tokenize("The Man said")
    assert tokenizer.detokenize(ids) == "the man said"
    assert tokenizer.unk not in ids


def test_bad_line_and_small_vocab(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    result = _train(path, "BertWordPieceCase", 100, tmp_path / "o")
    assert result.returncode == 2
    assert f"{path}:2: malformed JSON" in result.stderr
    assert os.listdir(tmp_path / "o") == []
    result = _train(path, "GPT2BPETokenizer", 100, tmp_path / "o")
    assert result.returncode == 2
    assert "--vocab-size 100: too small" in result.stderr


def test_fewer_tokens_than_asked_and_empty_input_warn(tmp_path):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "a tiny corpus, a tiny corpus"}\n')
    result = _train(tiny, "GPT2BPETokenizer", 1000, tmp_path / "o")
    assert result.returncode == 0, result.stderr
    size = len(json.loads((tmp_path / "o" / "vocab.json").read_text()))
    assert 257 <= size < 1000
    assert result.stderr.splitlines() == [
        f"warning: --vocab-size 1000: trained only {size} tokens; the corpus has too few "
        "distinct pieces seen at least --min-frequency 2 times (give more text or a lower "
        "--min-frequency)"
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _train(empty, "GPT2BPETokenizer", 1000, tmp_path / "e")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: --input {empty}: no text found under --json-keys text; the vocabulary holds "
        "only 257 base and special tokens"
    ]
