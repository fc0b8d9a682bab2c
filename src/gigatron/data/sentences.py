"""An offline English sentence splitter for `preprocess --split-sentences`.

Megatron uses NLTK's punkt model, which has to be downloaded; this rule-based splitter needs no
data files. A boundary is sentence-final punctuation (. ! ? or an ellipsis, then any closing quotes
or brackets), then whitespace, then a capital letter, a digit or an opening quote. A period does
not end a sentence after a known abbreviation ("Mr.", "e.g.", "Fig.") or an initial ("J. R. R.").
A blank line always ends a sentence (headings and list items have no final period).
"""

from __future__ import annotations

import re

from gigatron.errors import GigatronError

# Abbreviations after which a period almost never ends a sentence (compared lower-case, without
# their final period). "etc." is left out on purpose: it often ends a sentence.
ABBREVIATIONS = frozenset(
    """
    mr mrs ms mx dr prof sr jr st mt ft rev fr gen col maj capt cpt lt sgt cmdr adm gov sen rep pres
    hon messrs mme mlle esq
    e.g i.e cf vs v viz al approx ca circa incl est dept univ assn bros
    inc ltd co corp llc plc
    no nos vol vols p pp ch chap sec fig figs eq eqs ed eds op art
    jan feb mar apr jun jul aug sep sept oct nov dec
    mon tue tues wed thu thur thurs fri sat sun
    u.s u.k u.n e.u u.s.a d.c
    """.split()
)

_CLOSERS = "\"'\u201d\u2019)]}\u00bb"
_OPENERS = "\"'\u201c\u2018([{\u00ab"
_CANDIDATE = re.compile(r"(?:[.!?\u2026]+)[" + re.escape(_CLOSERS) + r"]*(?P<space>\s+)")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_INITIAL = re.compile(r"^[A-Z]$")


def _starts_sentence(text: str, position: int) -> bool:
    """True when the text at `position` can open a sentence."""
    while position < len(text) and text[position] in _OPENERS:
        position += 1
    if position >= len(text):
        return False
    char = text[position]
    return char.isupper() or char.isdigit() or (not char.isalpha() and not char.isspace())


def _period_is_abbreviation(text: str, start: int, punctuation_start: int) -> bool:
    """True when the single period at `punctuation_start` closes an abbreviation or initial."""
    word_start = punctuation_start
    while word_start > start and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start:punctuation_start].lstrip(_OPENERS)
    if not word:
        return False
    if word.lower() in ABBREVIATIONS or _INITIAL.match(word):
        return True
    # Dotted initialisms such as "a.m" / "U.S" not in the list end a sentence only when the
    # next word is capitalised, which the caller has already checked, so they split here.
    return False


def _split_paragraph(text: str, keep_newlines: bool) -> list[str]:
    sentences: list[str] = []
    start = 0
    for match in _CANDIDATE.finditer(text):
        space_start, space_end = match.span("space")
        if not _starts_sentence(text, space_end):
            continue
        punctuation = text[match.start() : space_start].rstrip(_CLOSERS)
        if punctuation == "." and _period_is_abbreviation(text, start, match.start()):
            continue
        end = space_end if keep_newlines and "\n" in match.group("space") else space_start
        sentences.append(text[start:end])
        start = space_end
    sentences.append(text[start:] if keep_newlines else text[start:].rstrip())
    return sentences


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split English `text` into sentences.

    Without `keep_newlines` the sentences are stripped of surrounding whitespace. With it, the
    whitespace after a sentence is kept at its end when it holds a newline, so that joining the
    sentences gives back the text's line structure (Megatron's `--keep-newlines`).
    """
    sentences: list[str] = []
    start = 0
    paragraphs: list[tuple[str, str]] = []
    for match in _PARAGRAPH_BREAK.finditer(text):
        paragraphs.append((text[start : match.start()], match.group()))
        start = match.end()
    paragraphs.append((text[start:], ""))
    for paragraph, separator in paragraphs:
        body = paragraph if keep_newlines else paragraph.strip()
        pieces = _split_paragraph(body, keep_newlines) if body.strip() else []
        if keep_newlines and pieces:
            pieces[-1] += separator
        sentences.extend(piece for piece in pieces if piece.strip())
    return sentences


# --lang of `preprocess --split-sentences`: the languages with a splitter.
SPLITTERS = {"english": split_sentences}


def sentence_splitter(language: str):
    """The splitter for `language` (see SPLITTERS)."""

    if language not in SPLITTERS:
        raise GigatronError(
            f"--lang {language}: no sentence splitter for it; available: {', '.join(SPLITTERS)}"
        )
    return SPLITTERS[language]
