"""Exact match and token F1 of a predicted answer against the reference answers, with SQuAD's
normalisation (lower case, punctuation removed, articles a/an/the removed, whitespace
collapsed), as Megatron's tools/retro/text_generation/evaluate.py scores QA; and Megatron's
clean-up of a generated answer before scoring."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# Megatron's read_prediction removes these answer markers wherever they stand
_MARKERS = ("Answer:", "????  ", "A:")


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def clean_prediction(text: str, eod_text: str = "<|endoftext|>") -> str:
    """The generated text as Megatron scores it: cut at the end-of-document text, newlines as
    spaces, answer markers removed, stripped."""
    if eod_text and eod_text in text:
        text = text[: text.index(eod_text)]
    text = text.strip().replace("\n", " ")
    for marker in _MARKERS:
        text = text.replace(marker, "")
    return text.strip()


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised answer, else 0.0."""
    guess = normalize_answer(prediction)
    return float(any(guess == normalize_answer(answer) for answer in answers))


def token_f1(prediction: str, answer: str) -> float:
    """Token-overlap F1 of two normalised texts (1.0 when both are empty)."""
    guess, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not guess or not gold:
        return float(guess == gold)
    same = sum((Counter(guess) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(guess), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, answers: Sequence[str]) -> float:
    """The best token F1 over the reference answers (SQuAD's)."""
    return max((token_f1(prediction, answer) for answer in answers), default=0.0)
