"""WikiText perplexity (Megatron's WIKITEXT103 task): the word-level tokenized file is turned
back into running text, tokenized whole, scored in windows of `seq_length` moved by
`overlapping_eval` tokens, and reported as token perplexity and as perplexity adjusted to the
number of original words."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from gigatron.errors import GigatronError
from gigatron.tasks.scoring import Sample
from gigatron.tasks.text_files import read_utf8

# Exact string replacements, applied in order (the wiki format's spacing around punctuation).
_NUMBER_SEPARATORS = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")]
_PUNCTUATION = [(" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? ")]
_PUNCTUATION += [(" , ", ", ")]
_BRACKETS = [
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)"),
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    (r"{\s*([^}]*?)\s*}", r"{\1}"),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    (r"'\s*([^']*?)\s*'", r"'\1'"),
]
_HEADINGS = [("= = = =", "===="), ("= = =", "==="), ("= =", "==")]
_FINAL = [(" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" \n", "\n"), ("\n ", "\n")]
_FINAL += [(" N ", " 1 "), (" 's", "'s")]


def wikitext_detokenize(text: str) -> str:
    """Megatron's wiki detokenizer (same rules, same order)."""
    text = text.replace("s '", "s'")
    # Megatron's rule here is a regex whose pattern and replacement are literal slashes and a
    # character class; kept as it is so that the token counts match Megatron's.
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for old, new in _NUMBER_SEPARATORS + _PUNCTUATION:
        text = text.replace(old, new)
    for pattern, replacement in _BRACKETS:
        text = re.sub(pattern, replacement, text)
    for old, new in _HEADINGS + _FINAL:
        text = text.replace(old, new)
    return text


def ptb_detokenize(text: str) -> str:
    """Megatron's Penn Treebank detokenizer (chosen for files whose path names 'ptb')."""
    for old, new in [(" '", "'"), (" \n", "\n"), ("\n ", "\n"), (" n't", "n't")]:
        text = text.replace(old, new)
    for old, new in [(" N ", "1 "), ("$ 1", "$1"), ("# 1", "#1")]:
        text = text.replace(old, new)
    return text


def detokenizer_for(path: str):
    return ptb_detokenize if "ptb" in path else wikitext_detokenize


@dataclass
class WikiTextData:
    tokens: list[int]
    num_original_tokens: int  # words of the file, split on single spaces (Megatron's count)
    num_tokenized_tokens: int


def read_wikitext(path: str, tokenizer) -> WikiTextData:
    text = read_utf8(path, "a WikiText file (wiki.valid.tokens or wiki.test.tokens)")
    if "\x00" in text:
        raise GigatronError(
            f"--valid-data {path}: a binary file (it holds NUL bytes); give a WikiText file "
            "(wiki.valid.tokens or wiki.test.tokens)"
        )
    num_original = len(text.strip().split(" "))
    tokens = list(tokenizer.tokenize(detokenizer_for(path)(text)))
    if len(tokens) < 2 or num_original < 2:
        raise GigatronError(
            f"--valid-data {path}: {len(tokens)} token(s), too few to score (at least 2 words "
            "are needed); give a WikiText file (wiki.valid.tokens or wiki.test.tokens)"
        )
    return WikiTextData(tokens, num_original, len(tokens))


def num_windows(num_tokens: int, stride: int) -> int:
    targets = max(num_tokens - 1 - stride, 0)
    return max(math.ceil(targets / stride) + 1, 1)


def window_samples(
    tokens: list[int], seq_length: int, overlapping_eval: int | None
) -> list[Sample]:
    """Windows of seq_length + 1 tokens starting every `stride` tokens; after the first window
    only the last `stride` targets count, so every target is scored exactly once."""
    stride = max(1, overlapping_eval or seq_length)
    samples = []
    for index in range(num_windows(len(tokens), stride)):
        start = index * stride
        window = np.asarray(tokens[start : start + seq_length + 1], dtype=np.int64)
        mask = np.ones(len(window) - 1, dtype=np.float32)
        if stride != seq_length and index != 0:
            mask[: max(0, seq_length - stride)] = 0
        samples.append(Sample(window, mask))
    return samples


def perplexities(
    total_loss: float, num_tokenized_tokens: int, num_original_tokens: int
) -> dict[str, float]:
    """Megatron's report: mean loss over the tokenized targets, its perplexity, and the
    perplexity adjusted by the ratio of tokenized to original targets (each capped at e^20)."""
    avg_loss = total_loss / (num_tokenized_tokens - 1)
    token_ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
    return {
        "avg_loss": avg_loss,
        "ppl": math.exp(min(20.0, avg_loss)),
        "adjusted_ppl": math.exp(min(20.0, avg_loss * token_ratio)),
        "token_ratio": token_ratio,
        "num_original_tokens": num_original_tokens,
        "num_tokenized_tokens": num_tokenized_tokens,
    }
