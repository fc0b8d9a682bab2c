"""BERT data as a user makes it: `gigatron preprocess --split-sentences` with
BertWordPieceLowerCase, then the BERT datasets of the training flags, checked against the text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gigatron.config import parse_config
from gigatron.data.bert_dataset import BertDataset, build_bert_datasets
from gigatron.data.indexed import IndexedDataset
from gigatron.data.preprocess import training_text
from gigatron.data.sentences import sentence_splitter
from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError
from helpers import gigatron, write_jsonl


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory, shared_data):
    """80 LAMBADA passages preprocessed into one sequence per sentence."""
    directory = tmp_path_factory.mktemp("bert_cli")
    lines = (shared_data / "lambada_test.jsonl").read_text().splitlines()[:80]
    texts = [json.loads(line)["text"] for line in lines]
    path = write_jsonl(directory / "corpus.jsonl", ({"text": t} for t in texts))
    vocab = str(shared_data / "bert-base-uncased-vocab.txt")
    gigatron("preprocess", "--input", str(path), "--output-prefix", str(directory / "lambada"),
             "--split-sentences", "--workers", "1", "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", vocab, timeout=120)  # fmt: skip
    split = sentence_splitter("english", training_text([str(path)], ["text"]))
    return str(directory / "lambada_text_sentence"), texts, vocab, split


def flags(prefix, vocab, *extra):
    return [
        "--data-path", prefix, "--split", "90,10,0", "--seq-length", "64", "--seed", "7",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, *extra,
    ]  # fmt: skip


def test_preprocess_then_bert_samples(sentence_data):
    prefix, texts, vocab, split = sentence_data
    cfg = parse_config(flags(prefix, vocab))
    tokenizer = build_tokenizer(cfg.tokenizer)
    low = IndexedDataset(prefix)
    assert len(low.document_indices) - 1 == len(texts)
    # Each document is its sentences, each tokenized alone.
    for d in (0, 41, 79):
        first, end = (int(x) for x in low.document_indices[d : d + 2])
        want = [tokenizer.tokenize(s) for s in split(texts[d])]
        assert [low[i].tolist() for i in range(first, end)] == want

    train, valid, test = build_bert_datasets(cfg, tokenizer, (200, 20, None))
    assert isinstance(train, BertDataset) and test is None
    assert len(train) >= 200 and len(valid) >= 20
    # valid holds documents [72, 80): its samples read only their sentences.
    assert np.asarray(valid.sample_index)[:, 0].min() >= int(low.document_indices[72])
    swapped = masked = real = 0
    for k in range(200):
        sample = train[k]
        tokens = sample["tokens"].copy()
        where = sample["loss_mask"] == 1
        tokens[where] = sample["labels"][where]
        n = int(sample["padding_mask"].sum())
        seps = np.flatnonzero(tokens[:n] == tokenizer.sep)
        assert tokens[0] == tokenizer.cls and len(seps) == 2 and seps[1] == n - 1
        assert not (where & np.isin(tokens, [tokenizer.cls, tokenizer.sep, tokenizer.pad])).any()
        a, b = tokens[1 : seps[0]].tolist(), tokens[seps[0] + 1 : n - 1].tolist()
        first, second = (b, a) if sample["is_random"] else (a, b)
        # In text order the segments are runs of the sample's sentences (trimmed at their ends).
        begin, end = (int(x) for x in train.sample_index[k][:2])
        text = [t for i in range(begin, end) for t in low[i].tolist()]
        assert first and second
        assert 0 <= position(first, text) < position(second, text, position(first, text))
        swapped += int(sample["is_random"])
        masked += int(where.sum())
        real += n
    assert 60 <= swapped <= 140  # a fair coin over 200 samples, well within 4 sigma
    assert 0.12 < masked / real <= 0.15


def position(run: list[int], text: list[int], after: int = -1) -> int:
    """Where `run` occurs in `text` after index `after` (-1 if nowhere)."""
    for start in range(after + 1, len(text) - len(run) + 1):
        if text[start : start + len(run)] == run:
            return start
    return -1


def test_flags_reach_the_samples(sentence_data):
    prefix, _, vocab, _ = sentence_data
    cfg = parse_config(
        flags(prefix, vocab, "--bert-no-binary-head", "--mask-prob", "0.3", "--short-seq-prob", "0")
    )
    assert (cfg.model.bert_binary_head, cfg.data.mask_prob, cfg.data.short_seq_prob) == (
        False, 0.3, 0.0,
    )  # fmt: skip
    tokenizer = build_tokenizer(cfg.tokenizer)
    train = build_bert_datasets(cfg, tokenizer, (50, 0, None))[0]
    assert (np.asarray(train.sample_index)[:, 2] == 61).all()  # no short targets
    shares = []
    for k in range(50):
        sample = train[k]
        assert not sample["token_types"].any() and int(sample["is_random"]) == 0
        shares.append(sample["loss_mask"].sum() / sample["padding_mask"].sum())
    assert 0.25 < np.mean(shares) <= 0.3
    with pytest.raises(GigatronError, match="--mask-prob 1.5"):
        parse_config(flags(prefix, vocab, "--mask-prob", "1.5"))
