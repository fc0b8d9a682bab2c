"""Sentence splitting for `preprocess --split-sentences`: NLTK's punkt, as Megatron uses.

Punkt needs parameters for its language. When NLTK's `punkt_tab` data for the language is
installed (`nltk.download("punkt_tab")`, read as plain tables, never a pickle), that model is
used. Otherwise punkt is trained on the fly on the start of the input itself (NLTK's trainer
needs no download), with a list of common English abbreviations added for English. Which of the
two split a dataset is recorded beside it (`<dataset>.json`, see preprocess.py). A blank line
always ends a sentence (headings and list items have no final period).
"""

from __future__ import annotations

import re
from typing import Any

from gigatron.errors import GigatronError

# Abbreviations after which a period almost never ends an English sentence (lower-case, without
# their final period); they seed the trained model, which may not see them often enough.
# "etc." is left out on purpose: it often ends a sentence.
ABBREVIATIONS = frozenset(
    """
    mr mrs ms mx dr prof sr jr st mt ft rev fr gen col maj capt cpt lt sgt cmdr adm gov sen rep pres
    hon messrs mme mlle esq
    e.g i.e cf vs v viz al approx ca circa incl est dept univ assn bros
    inc ltd co corp llc plc
    no nos vol vols p pp ch chap sec fig figs eq eqs ed eds op art
    jan feb mar apr jun jul aug sep sept oct nov dec
    mon tue tues wed thu thur thurs fri sat sun
    u.s u.k u.n e.u u.s.a d.c a.m p.m
    """.split()
)
# Characters of input text the on-the-fly model is trained on: enough for punkt's statistics,
# small enough to train in seconds.
TRAINING_CHARS = 1_000_000
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def _nltk_punkt() -> Any:
    try:
        from nltk.tokenize import punkt  # why: only --split-sentences needs NLTK
    except ImportError:
        raise GigatronError(
            "--split-sentences: needs NLTK (a gigatron dependency); pip install nltk"
        ) from None
    return punkt


class SentenceSplitter:
    """Punkt with fixed parameters; `description` says where they came from."""

    def __init__(self, parameters: Any, description: str) -> None:
        self.tokenizer = _nltk_punkt().PunktSentenceTokenizer(parameters)
        self.description = description

    def _split_paragraph(self, text: str, keep_newlines: bool) -> list[str]:
        spans = list(self.tokenizer.span_tokenize(text))
        sentences = []
        for index, (start, end) in enumerate(spans):
            following = spans[index + 1][0] if index + 1 < len(spans) else len(text)
            gap = text[end:following]
            sentences.append(
                text[start:following] if keep_newlines and "\n" in gap else text[start:end]
            )
        return sentences

    def __call__(self, text: str, keep_newlines: bool = False) -> list[str]:
        """The sentences of `text`. Without `keep_newlines` they are stripped; with it, the
        whitespace after a sentence is kept at its end when it holds a newline, so that joining
        the sentences gives back the text's line structure (Megatron's `--keep-newlines`)."""
        sentences: list[str] = []
        start = 0
        for match in [*_PARAGRAPH_BREAK.finditer(text), None]:
            end = match.start() if match else len(text)
            pieces = self._split_paragraph(text[start:end].strip(), keep_newlines)
            if keep_newlines and pieces and match:
                pieces[-1] += match.group()
            sentences.extend(piece for piece in pieces if piece.strip())
            start = match.end() if match else len(text)
        return sentences


def installed_model(language: str) -> SentenceSplitter | None:
    """NLTK's punkt_tab model of `language`, when its data is installed."""
    punkt = _nltk_punkt()
    from nltk import data  # why: only --split-sentences needs NLTK

    try:
        data.find(f"tokenizers/punkt_tab/{language}/")
    except LookupError:
        return None
    model = punkt.PunktTokenizer(language)
    return SentenceSplitter(model._params, f"NLTK punkt_tab model '{language}'")


def trained_model(language: str, text: str) -> SentenceSplitter:
    """Punkt trained on `text` (the start of the input), English abbreviations added."""
    trainer = _nltk_punkt().PunktTrainer()
    trainer.train(text[:TRAINING_CHARS], finalize=True)
    parameters = trainer.get_params()
    seeded = ABBREVIATIONS if language == "english" else frozenset()
    parameters.abbrev_types.update(seeded)
    return SentenceSplitter(
        parameters,
        f"punkt trained on {min(len(text), TRAINING_CHARS)} characters of the input"
        + (f" plus {len(seeded)} listed English abbreviations" if seeded else ""),
    )


def sentence_splitter(language: str, training_text: str, use_installed: bool = True):
    """The splitter of `language`: NLTK's installed model, else punkt trained on the text."""
    if not re.fullmatch(r"[a-z_]+", language):
        raise GigatronError(f"--lang {language}: give a language name such as english or german")
    splitter = installed_model(language) if use_installed else None
    return splitter or trained_model(language, training_text)
