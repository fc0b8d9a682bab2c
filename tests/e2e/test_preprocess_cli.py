"""`gigatron preprocess` and `gigatron merge` driven as a user does, checked token by token."""

from __future__ import annotations

import gzip
import json
import os
import subprocess

import numpy as np
import pytest

import helpers
from gigatron.data.indexed import IndexedDataset
from gigatron.data.preprocess import training_text
from gigatron.data.sentences import sentence_splitter

EXTRA_DOCUMENTS = [
    {"text": "Mr. Smith went to Washington. He arrived at 3.30 p.m. on Monday. It rained!"},
    {"text": ""},  # empty: skipped and counted
    {"text": "Ünïcödé façade — 東京. Second sentence here."},
]


def gpt2_flags(shared_data) -> list[str]:
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(shared_data / "gpt2-vocab.json"),
        "--merge-file",
        str(shared_data / "gpt2-merges.txt"),
    ]


def gigatron(*args: str) -> subprocess.CompletedProcess:
    return helpers.gigatron(*args, check=False, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data):
    """60 LAMBADA passages plus hand-written documents, as JSON lines."""
    directory = tmp_path_factory.mktemp("corpus")
    lines = (shared_data / "lambada_test.jsonl").read_text().splitlines()[:60]
    documents = [json.loads(line) for line in lines] + EXTRA_DOCUMENTS
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in documents))
    return path, [d["text"] for d in documents]


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer):
    return gpt2_tokenizer


def test_documents_match_direct_tokenization(tmp_path, shared_data, corpus, tokenizer):
    path, texts = corpus
    prefix = tmp_path / "out"
    result = gigatron(
        "preprocess",
        "--input",
        str(path),
        "--output-prefix",
        str(prefix),
        "--append-eod",
        "--workers",
        "2",
        *gpt2_flags(shared_data),
    )
    assert result.returncode == 0, result.stderr
    assert "skipped empty:    1" in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["out_text_document.bin", "out_text_document.idx"]
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset.dtype == np.uint16
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts if t]
    assert len(dataset) == len(expected)
    assert dataset.document_indices.tolist() == list(range(len(expected) + 1))
    for sequence, ids in zip(dataset[:], expected):
        assert sequence.tolist() == ids

    # --partitions 2 writes the same bytes (and leaves no partition files behind).
    parted = tmp_path / "parted"
    result = gigatron(
        "preprocess",
        "--input",
        str(path),
        "--output-prefix",
        str(parted),
        "--append-eod",
        "--workers",
        "1",
        "--partitions",
        "2",
        *gpt2_flags(shared_data),
    )
    assert result.returncode == 0, result.stderr
    for ext in ("bin", "idx"):
        assert (tmp_path / f"parted_text_document.{ext}").read_bytes() == (
            tmp_path / f"out_text_document.{ext}"
        ).read_bytes()
    assert len(os.listdir(tmp_path)) == 4

    # merge: two copies concatenated equal a dataset of the doubled corpus.
    result = gigatron(
        "merge",
        "--input",
        f"{prefix}_text_document",
        f"{parted}_text_document",
        "--output-prefix",
        str(tmp_path / "merged"),
    )
    assert result.returncode == 0, result.stderr
    merged = IndexedDataset(tmp_path / "merged")
    assert len(merged) == 2 * len(expected)
    assert merged.document_indices.tolist() == list(range(2 * len(expected) + 1))
    assert [s.tolist() for s in merged[:]] == expected + expected


def test_split_sentences_and_gzip_and_keys(tmp_path, shared_data, tokenizer):
    documents = [
        {"text": "Mr. Smith went to Washington. He arrived at 3.30 p.m. on Monday.", "title": "A"},
        {"text": "One sentence only", "title": ""},
        {"text": "", "title": "B"},  # empty text, non-empty title: kept as an empty document
    ]
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as stream:
        stream.writelines(json.dumps(d) + "\n" for d in documents)
    result = gigatron(
        "preprocess",
        "--input",
        str(tmp_path / "*.jsonl.gz"),
        "--output-prefix",
        str(tmp_path / "s"),
        "--json-keys",
        "text",
        "title",
        "--split-sentences",
        "--workers",
        "1",
        *gpt2_flags(shared_data),
    )
    assert result.returncode == 0, result.stderr
    text = IndexedDataset(tmp_path / "s_text_sentence")
    # the splitter preprocess trains on the start of its input (no punkt_tab data installed)
    split = sentence_splitter("english", training_text([str(path)], ["text", "title"]))
    record = json.loads((tmp_path / "s_text_sentence.json").read_text())
    assert record["sentence_splitter"] == split.description
    # the six texts (64 + 1 + 17 + 0 + 0 + 1 characters) joined by five blank lines
    assert split.description.startswith("punkt trained on 93 characters of the input")
    sentences = [split(d["text"]) for d in documents]
    assert sentences[0] == ["Mr. Smith went to Washington.", "He arrived at 3.30 p.m. on Monday."]
    expected = [tokenizer.tokenize(s) for doc in sentences for s in doc]
    assert [s.tolist() for s in text[:]] == expected
    assert text.document_indices.tolist() == [0, 2, 3, 3]
    title = IndexedDataset(tmp_path / "s_title_sentence")
    assert [s.tolist() for s in title[:]] == [tokenizer.tokenize("A"), tokenizer.tokenize("B")]
    assert title.document_indices.tolist() == [0, 1, 1, 2]


BAD_LINES = [
    (b'{"text": "fine"}\n{"text": "broken\n', "malformed JSON", "2"),
    (b'{"text": "fine"}\n{"body": "no text key"}\n', "missing key 'text'", "1"),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "invalid UTF-8", "1"),
]


def _preprocess(path, prefix, shared_data, *flags: str):
    return gigatron(
        "preprocess", "--input", str(path), "--output-prefix", str(prefix), *flags,
        *gpt2_flags(shared_data),
    )  # fmt: skip


@pytest.mark.parametrize(("content", "message", "workers"), BAD_LINES, ids=["json", "key", "utf8"])
def test_bad_line_stops_with_file_and_line(tmp_path, shared_data, content, message, workers):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "first"}\n' + content)
    result = _preprocess(path, tmp_path / "out", shared_data, "--workers", workers)
    assert result.returncode == 2
    assert f"{path}:3: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing half-written


def test_skip_invalid_counts(tmp_path, shared_data, tokenizer):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        b'{"text": "good one"}\n'
        b"not json\n"
        b'{"other": 1}\n'
        b'{"text": "caf\xe9"}\n'
        b'{"text": 5}\n'
        b"\n"
        b'{"text": "good two"}\n'
    )
    result = _preprocess(path, tmp_path / "out", shared_data, "--skip-invalid", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "skipped invalid:  4" in result.stdout
    assert "skipped empty:    1" in result.stdout
    assert f"{path}:2: malformed JSON" in result.stderr
    dataset = IndexedDataset(tmp_path / "out_text_document")
    assert [s.tolist() for s in dataset[:]] == [
        tokenizer.tokenize("good one"),
        tokenizer.tokenize("good two"),
    ]


def test_missing_tokenizer_file_and_input(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    result = gigatron(
        "preprocess",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
    )
    assert result.returncode == 2
    assert "--vocab-file is required" in result.stderr
    result = gigatron(
        "preprocess",
        "--input",
        str(tmp_path / "none*.jsonl"),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
    )
    assert result.returncode == 2
    assert "matches no file" in result.stderr
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_merge_rejects_mixed_dtypes(tmp_path):
    from gigatron.data.indexed import write_dataset

    write_dataset(tmp_path / "a", [[[1, 2]]], dtype=np.uint16)
    write_dataset(tmp_path / "b", [[[3]]], dtype=np.int32)
    result = gigatron(
        "merge", "--input-dir", str(tmp_path), "--output-prefix", str(tmp_path / "out")
    )
    assert result.returncode == 2
    assert "different token dtypes" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.bin", "b.idx"]


def test_null_tokenizer_ids_out_of_range(tmp_path, capsys):
    from gigatron.data.preprocess import main
    from gigatron.errors import GigatronError

    path = tmp_path / "ids.jsonl"
    path.write_text('{"text": "1 2 3"}\n{"text": "4 50"}\n{"text": "x y"}\n{"text": "5"}\n')
    flags = ["--input", str(path), "--output-prefix", str(tmp_path / "n")]
    flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "1"]
    with pytest.raises(GigatronError, match=r"ids\.jsonl:2: token id outside the vocabulary"):
        main(flags)
    assert os.listdir(tmp_path) == ["ids.jsonl"]
    assert main([*flags, "--skip-invalid", "--append-eod"]) == 0
    assert "skipped invalid:  2" in capsys.readouterr().out
    dataset = IndexedDataset(tmp_path / "n_text_document")
    assert [s.tolist() for s in dataset[:]] == [[1, 2, 3, 9], [5, 9]]


def test_output_directories_are_created_and_empty_input_warns(tmp_path, shared_data):
    """`--output-prefix data/corpus` works when data/ does not exist yet; an input without
    documents says so in one line and in the report."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    prefix = tmp_path / "new" / "deeper" / "corpus"
    result = gigatron(
        "preprocess", "--input", str(empty), "--output-prefix", str(prefix), "--workers", "1",
        *gpt2_flags(shared_data),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert IndexedDataset(f"{prefix}_text_document").__len__() == 0
    assert "documents:        0" in result.stdout
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warning == [
        f"warning: --input {empty}: no documents found (1 empty, 0 invalid); the datasets "
        "written are empty and cannot be trained on"
    ]
    assert "UserWarning" not in result.stderr and "warnings.warn" not in result.stderr


def test_tiktoken_and_reference_outputs_are_byte_identical(tmp_path, shared_data, monkeypatch):
    """The shipped tokenizer path (tiktoken) and the HF reference write the same files from
    real text: WikiText-2 lines (whitespace, headings) and LAMBADA passages."""
    from gigatron.data import preprocess, tokenizers

    wiki = (shared_data / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8")
    texts = wiki.splitlines(keepends=True)[:1500]
    texts += [
        json.loads(line)["text"]
        for line in (shared_data / "lambada_test.jsonl").read_text().splitlines()[:500]
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def run(name: str) -> tuple[bytes, bytes]:
        prefix = tmp_path / name
        argv = ["--input", str(path), "--output-prefix", str(prefix), "--workers", "1"]
        assert preprocess.main([*argv, "--append-eod", *gpt2_flags(shared_data)]) == 0
        stem = tmp_path / f"{name}_text_document"
        return stem.with_suffix(".bin").read_bytes(), stem.with_suffix(".idx").read_bytes()

    fast = run("fast")
    built: list = []
    original = tokenizers.GPT2BPETokenizer

    class Reference(original):
        def __init__(self, vocab_file: str, merge_file: str) -> None:
            super().__init__(vocab_file, merge_file, backend="hf")
            built.append(self)

    monkeypatch.setattr(tokenizers, "GPT2BPETokenizer", Reference)
    reference = run("reference")
    assert built and built[0].backend == "hf"
    assert len(fast[0]) > 200_000
    assert fast == reference
