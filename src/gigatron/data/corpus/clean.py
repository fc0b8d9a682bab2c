"""Document cleaning: ftfy text repair, whitespace and punctuation standardisation, a language
filter (py3langid) and a minimum length; each dropped document counted by its reason.

The rules follow the steps Megatron's corpus recipe describes (ftfy, English detection,
documents under 128 GPT-2 tokens removed); ftfy and py3langid are the `corpus` extra.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from gigatron.errors import GigatronError

# Typographic characters -> their plain ASCII spelling (the punctuation standardisation).
PUNCTUATION = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u201b": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u00ab": '"',
        "\u00bb": '"',
        "\u2013": "-",
        "\u2014": " - ",
        "\u2212": "-",
        "\u2026": "...",
        "\u00a0": " ",
        "\u2009": " ",
        "\u200b": "",
    }
)
_SPACES = re.compile(r"[ \t\f\v]+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r" +([,.;:!?])")
_BLANK_LINES = re.compile(r"\n{3,}")


def standardise(text: str) -> str:
    """Typographic punctuation to ASCII, runs of blanks to one space, at most one empty line."""
    text = text.translate(PUNCTUATION).replace("\r\n", "\n").replace("\r", "\n")
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    text = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", "\n".join(lines))
    return _BLANK_LINES.sub("\n\n", text).strip()


@dataclass(frozen=True)
class CleanRules:
    language: str | None  # an ISO 639-1 code, or None to keep every language
    min_tokens: int
    fix_text: bool = True


def import_corpus_extra(module: str):
    """`module` of the corpus extra, or a GigatronError saying how to install it."""
    import importlib  # why: the corpus extra is optional

    try:
        return importlib.import_module(module)
    except ImportError:
        raise GigatronError(
            f"gigatron data needs the '{module}' package; pip install 'gigatron[corpus]'"
        ) from None


def clean_document(
    text: str, rules: CleanRules, count_tokens: Callable[[str], int]
) -> tuple[str | None, str]:
    """(the cleaned text, "kept"), or (None, the reason it was dropped)."""
    if rules.fix_text:
        text = import_corpus_extra("ftfy").fix_text(text)
    text = standardise(text)
    if not text:
        return None, "empty"
    # Length first: it is cheaper, and language detection is unreliable on short texts.
    if count_tokens(text) < rules.min_tokens:
        return None, "too_short"
    if rules.language is not None:
        detected = import_corpus_extra("py3langid").classify(text)[0]
        if detected != rules.language:
            return None, "language"
    return text, "kept"
