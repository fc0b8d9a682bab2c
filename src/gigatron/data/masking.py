"""Masked-language-model predictions: Megatron-Core's whole-word n-gram masking.

Candidates are words: a WordPiece token starting with "##" continues the word before it
([CLS] and [SEP] are never candidates). Up to `min(p * target_length,
max(1, round(p * len(tokens))))` tokens are masked: the candidates are visited in a random
order; each draws an n-gram size n in 1..max_ngram with P(n) proportional to 1/n (the n words
starting at it), or with `geometric` (SpanBERT, T5) n = min(Geometric(0.2), max_ngram), shrunk
while it would overshoot the budget, and is skipped if any of its tokens is already masked.
BERT (`replacement="bert"`): each chosen token becomes [MASK] with probability 0.8, a uniformly
random vocabulary id with probability 0.1, and stays unchanged with probability 0.1. T5
(`replacement="mask"`): always [MASK], with no random draw.

The random draws, their order and the arithmetic follow Megatron-Core's MaskedWordPieceDataset
with numpy's RandomState, so a sample seeded alike is masked alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskingOptions:
    """The masking recipe and the vocabulary facts it needs."""

    probability: float
    mask_id: int
    special_ids: frozenset[int]  # never candidates ([CLS], [SEP])
    is_continuation: np.ndarray  # bool per token id: the piece continues a word ("##...")
    vocab_ids: np.ndarray  # ids a random replacement is drawn from
    max_ngram: int = 3
    whole_word: bool = True
    geometric: bool = False  # span sizes from a geometric distribution (p = 0.2)
    replacement: str = "bert"  # "bert" (80/10/10) or "mask" (always [MASK])


def word_candidates(tokens: list[int], options: MaskingOptions) -> list[list[int]]:
    """Positions grouped into maskable units: whole words, or single pieces without whole_word."""
    words: list[list[int]] = []
    for position, token in enumerate(tokens):
        if token in options.special_ids:
            continue
        if options.whole_word and words and options.is_continuation[token]:
            # A word's continuation joins the last word seen, even across a [SEP] (as Megatron).
            words[-1].append(position)
        else:
            words.append([position])
    return words


def _ngram_probabilities(max_ngram: int) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.arange(max_ngram, dtype=np.int64) + 1
    probabilities = 1.0 / sizes
    probabilities = probabilities / probabilities.sum(keepdims=True)
    # Megatron normalises the (already normalised) slice once more before each draw.
    return sizes, probabilities / probabilities.sum(keepdims=True)


def create_masked_lm_predictions(
    tokens: list[int],
    target_length: int,
    rng: np.random.RandomState,
    options: MaskingOptions,
) -> tuple[list[int], list[int], list[int]]:
    """(masked tokens, masked positions (sorted), their original ids)."""
    masked, positions, originals, _ = create_masked_spans(tokens, target_length, rng, options)
    return masked, positions, originals


def create_masked_spans(
    tokens: list[int],
    target_length: int,
    rng: np.random.RandomState,
    options: MaskingOptions,
) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """(masked tokens, masked positions (sorted), their original ids, the masked spans: each
    the positions of one chosen n-gram, spans ordered by their first position)."""
    words = word_candidates(tokens, options)
    budget = min(
        options.probability * target_length,
        max(1, int(round(len(tokens) * options.probability))),
    )
    sizes, probabilities = _ngram_probabilities(options.max_ngram)
    order = list(range(len(words)))
    rng.shuffle(order)

    masked = list(tokens)
    chosen: dict[int, int] = {}  # position -> original id
    spans: list[list[int]] = []
    for start in order:
        if len(chosen) >= budget:
            break
        if options.geometric:
            n = min(int(rng.geometric(0.2)), options.max_ngram)
        else:
            n = int(rng.choice(sizes, p=probabilities))
        while True:
            span = [p for word in words[start : start + n] for p in word]
            n -= 1
            if budget >= len(chosen) + len(span):
                break
            if n == 0:
                span = []
                break
        if not span or any(p in chosen for p in span):
            continue
        for position in span:
            chosen[position] = tokens[position]
            masked[position] = _replacement(tokens[position], rng, options)
        spans.append(span)
    positions = sorted(chosen)
    spans.sort(key=lambda span: span[0])
    return masked, positions, [chosen[p] for p in positions], spans


def _replacement(token: int, rng: np.random.RandomState, options: MaskingOptions) -> int:
    """[MASK] (80%), a random vocabulary id (10%), or the token itself (10%); T5: [MASK]."""
    if options.replacement == "mask":
        return options.mask_id
    if rng.random_sample() < 0.8:
        return options.mask_id
    if rng.random_sample() >= 0.5:
        return int(options.vocab_ids[rng.randint(0, len(options.vocab_ids))])
    return token
