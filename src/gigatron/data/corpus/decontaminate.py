"""13-gram decontamination of training documents against evaluation sets.

The rule, with Megatron's `filter_ngrams` defaults: words are the lower-cased `\\w+` runs; every
13-word window of an evaluation text is a contaminating n-gram (a text of 8 to 12 words counts as
one whole n-gram). An n-gram found in `key_threshold` or more training documents is common
language, not contamination, and is ignored. In a document, at each match the text is cut: the
piece before ends at the last sentence mark (. ! ?) at or before 200 characters before the match,
the rest starts after the first sentence mark at or after 200 characters past it, and is scanned
again. Pieces of 200 characters or fewer are dropped, and so is a document cut into more than 10
pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

_WORD = re.compile(r"\w+")
SENTENCE_MARKS = ".!?"


def _rule(default: int, flag: str, help: str) -> Any:
    return field(default=default, metadata={"flag": flag, "help": help})


@dataclass(frozen=True)
class NgramRules:
    """Megatron's filter_ngrams rules, each with its command-line flag (its defaults)."""

    max_ngram: int = _rule(13, "--max-ngram-size", "words in an n-gram")
    min_ngram: int = _rule(8, "--min-ngram-size", "shorter eval texts count whole from here")
    remove_char_each_side: int = _rule(
        200, "--remove-char-each-side", "characters cut around a match"
    )
    min_piece_chars: int = _rule(200, "--filter-text-char-len", "pieces this short are dropped")
    max_splits: int = _rule(10, "--splits-count", "documents cut into more pieces are dropped")
    key_threshold: int = _rule(
        10,
        "--key-threshold",
        "n-grams in this many training documents or more are common language, not leaks",
    )

    @staticmethod
    def add_flags(parser: Any) -> None:
        for rule in fields(NgramRules):
            meta = rule.metadata
            parser.add_argument(
                meta["flag"], dest=rule.name, type=int, default=rule.default, help=meta["help"]
            )

    @classmethod
    def from_args(cls, args: Any) -> NgramRules:
        return cls(**{rule.name: getattr(args, rule.name) for rule in fields(cls)})


def words_and_spans(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    found = list(_WORD.finditer(text.lower()))
    return [m.group(0) for m in found], [m.span() for m in found]


def evaluation_ngrams(texts: Iterable[str], rules: NgramRules) -> set[tuple[str, ...]]:
    """The contaminating n-grams of the evaluation texts."""
    ngrams: set[tuple[str, ...]] = set()
    for text in texts:
        words, _ = words_and_spans(text)
        if rules.min_ngram <= len(words) < rules.max_ngram:
            ngrams.add(tuple(words))
        for start in range(len(words) - rules.max_ngram + 1):
            ngrams.add(tuple(words[start : start + rules.max_ngram]))
    return ngrams


def first_match(
    words: list[str], ngrams: set[tuple[str, ...]], lengths: list[int]
) -> tuple[int, int] | None:
    """(first word, word count) of the earliest n-gram of `words` in `ngrams`."""
    for start in range(len(words)):
        for length in lengths:
            if start + length <= len(words) and tuple(words[start : start + length]) in ngrams:
                return start, length
    return None


def ngrams_present(text: str, ngrams: set[tuple[str, ...]], lengths: list[int]) -> set:
    """The n-grams of `ngrams` that occur in `text` (for the frequency pass)."""
    words, _ = words_and_spans(text)
    return {
        tuple(words[s : s + n])
        for n in lengths
        for s in range(len(words) - n + 1)
        if tuple(words[s : s + n]) in ngrams
    }


def cut_around(text: str, begin: int, end: int, width: int) -> tuple[str, str]:
    """The text before `begin - width` up to a sentence mark, and after `end + width` from one."""
    position = begin - width
    while position > 0 and text[position] not in SENTENCE_MARKS:
        position -= 1
    before = text[: position + 1] if position > 0 else ""
    position = end + width
    while position < len(text) and text[position] not in SENTENCE_MARKS:
        position += 1
    after = text[position + 1 :] if position + 1 < len(text) else ""
    return before, after


def decontaminate(
    text: str, ngrams: set[tuple[str, ...]], rules: NgramRules
) -> tuple[list[str], int]:
    """(the clean pieces of `text` (empty: drop the document), the number of matches cut)."""
    lengths = sorted({len(ngram) for ngram in ngrams}, reverse=True)
    pieces: list[str] = []
    pending, matches = text, 0
    while pending:
        words, spans = words_and_spans(pending)
        match = first_match(words, ngrams, lengths)
        if match is None:
            pieces.append(pending)
            break
        matches += 1
        start, length = match
        before, pending = cut_around(
            pending, spans[start][0], spans[start + length - 1][1], rules.remove_char_each_side
        )
        if len(before) > rules.min_piece_chars:
            pieces.append(before)
        if len(pending) <= rules.min_piece_chars:
            break
    if len(pieces) > rules.max_splits:
        return [], matches
    return pieces, matches
