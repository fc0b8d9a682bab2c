"""Masked-LM predictions on real WordPiece text: budget, 80/10/10, special tokens, whole words."""

from __future__ import annotations

import numpy as np
import pytest

from gigatron.data.bert_dataset import BertDatasetOptions
from gigatron.data.masking import create_masked_lm_predictions, word_candidates
from gigatron.data.tokenizers import BertWordPieceTokenizer


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    return BertWordPieceTokenizer(str(shared_data / "bert-base-uncased-vocab.txt"), lower_case=True)


@pytest.fixture(scope="module")
def pairs(tokenizer, shared_data):
    """[CLS] A [SEP] B [SEP] of 62 tokens from wikitext lines."""
    text = (shared_data / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if len(line.split()) > 40]
    result = []
    for line in lines[:1500]:
        ids = tokenizer.tokenize(line)[:60]
        if len(ids) == 60:
            result.append([tokenizer.cls, *ids[:25], tokenizer.sep, *ids[25:], tokenizer.sep])
    assert len(result) > 1000
    return result


def options(tokenizer, mask_prob=0.15):
    return BertDatasetOptions.from_tokenizer(tokenizer, seq_length=128, mask_prob=mask_prob).masking


def test_shares_and_special_tokens(tokenizer, pairs):
    masking = options(tokenizer)
    total = masked = 0
    kinds = {"mask": 0, "random": 0, "kept": 0}
    for k, tokens in enumerate(pairs):
        out, positions, labels = create_masked_lm_predictions(
            tokens, 125, np.random.RandomState(k), masking
        )
        # budget min(0.15 * 125, max(1, round(0.15 * 62))) = 9; whole words may leave it short.
        assert 6 <= len(positions) <= 9
        assert positions == sorted(set(positions))
        assert labels == [tokens[p] for p in positions]
        assert all(tokens[p] not in (tokenizer.cls, tokenizer.sep) for p in positions)
        unmasked = set(range(len(tokens))) - set(positions)
        assert all(out[p] == tokens[p] for p in unmasked)
        for p in positions:
            kind = (
                "mask" if out[p] == tokenizer.mask else "kept" if out[p] == tokens[p] else "random"
            )
            kinds[kind] += 1
        total += len(tokens)
        masked += len(positions)
    n = masked
    # Each masked token: [MASK] 0.8, random 0.1, kept 0.1 (a random id equal to the token is
    # counted as kept: 1 in 30524). Four standard deviations of a binomial share.
    assert abs(kinds["mask"] / n - 0.8) < 4 * np.sqrt(0.16 / n)
    assert abs(kinds["random"] / n - 0.1) < 4 * np.sqrt(0.09 / n)
    assert abs(kinds["kept"] / n - 0.1) < 4 * np.sqrt(0.09 / n)
    # 9 of 62 tokens is 14.5%; whole words that would overshoot the budget are skipped.
    assert 0.14 < masked / total <= 9 / 62


def test_masked_share_follows_mask_prob(tokenizer, pairs):
    masking = options(tokenizer, mask_prob=0.3)
    counts = [
        len(create_masked_lm_predictions(t, 125, np.random.RandomState(k), masking)[1])
        for k, t in enumerate(pairs[:300])
    ]
    # budget round(0.3 * 62) = 19
    assert max(counts) == 19 and np.mean(counts) > 17.5


def test_whole_words_are_masked_together(tokenizer):
    masking = options(tokenizer)
    ids = tokenizer.tokenize("unbelievably hyperparameterization tokenizers " * 6)
    tokens = [tokenizer.cls, *ids, tokenizer.sep]
    words = word_candidates(tokens, masking)
    assert all(len(word) > 1 for word in words)  # each word here is several pieces
    assert [tokenizer.inv_vocab[tokens[p]].startswith("##") for p in words[0]] == [False] + [
        True
    ] * (len(words[0]) - 1)
    partial = 0
    for seed in range(200):
        _, positions, _ = create_masked_lm_predictions(
            tokens, 200, np.random.RandomState(seed), masking
        )
        chosen = set(positions)
        partial += sum(0 < len(chosen & set(word)) < len(word) for word in words)
    assert partial == 0


def test_budget_by_hand_and_determinism(tokenizer):
    masking = options(tokenizer)
    ids = tokenizer.tokenize("the cat sat on a mat and the dog ran to the old red barn")
    assert all(not tokenizer.inv_vocab[i].startswith("##") for i in ids)
    tokens = [tokenizer.cls, *ids, tokenizer.sep]  # 18 single-piece tokens
    # min(0.15 * 125, max(1, round(0.15 * 18) = 3)) = 3: single-piece words always fit.
    for seed in range(20):
        assert (
            len(create_masked_lm_predictions(tokens, 125, np.random.RandomState(seed), masking)[1])
            == 3
        )
    # A short target caps it: min(0.15 * 10 = 1.5, 3) -> 1.
    assert len(create_masked_lm_predictions(tokens, 10, np.random.RandomState(0), masking)[1]) == 1
    first = create_masked_lm_predictions(tokens, 125, np.random.RandomState(7), masking)
    again = create_masked_lm_predictions(tokens, 125, np.random.RandomState(7), masking)
    assert first == again
