"""LAMBADA (Megatron's task): predict the last word of each passage; a passage counts as right
when the greedy (arg-max) prediction of every target token is the target."""

from __future__ import annotations

import json

import numpy as np

from gigatron.errors import GigatronError
from gigatron.tasks.scoring import Sample
from gigatron.tasks.text_files import read_utf8


def split_passage(text: str, tokenizer, strict: bool) -> tuple[list[int], list[int]]:
    """(context tokens, target tokens). Not strict: the passage's last token is the target.
    Strict: the whole last word, tokenized with its leading space, after the context up to it."""
    if not strict:
        tokens = list(tokenizer.tokenize(text))
        return tokens[:-1], tokens[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    context = list(tokenizer.tokenize(text[:start].strip()))
    return context, list(tokenizer.tokenize(" " + last_word))


def passage_sample(context: list[int], target: list[int], seq_length: int) -> Sample:
    """Context and target as one sample scored on the target only; a context too long for the
    model loses its first tokens."""
    keep = seq_length + 1 - len(target)
    if keep < 1:
        raise GigatronError(
            f"a LAMBADA target of {len(target)} tokens does not fit --seq-length {seq_length}"
        )
    context = context[-keep:]
    tokens = np.asarray(context + target, dtype=np.int64)
    mask = np.zeros(len(tokens) - 1, dtype=np.float32)
    mask[len(context) - 1 :] = 1
    return Sample(tokens, mask)


def read_lambada(path: str, tokenizer, seq_length: int, strict: bool) -> list[Sample]:
    samples = []
    text = read_utf8(path, 'a LAMBADA file (one {"text": ...} per line)')
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        text = passage_text(path, number, line)
        context, target = split_passage(text, tokenizer, strict)
        if not context:
            raise GigatronError(
                f"--valid-data {path}: line {number} has no context before its last word"
            )
        samples.append(passage_sample(context, target, seq_length))
    if not samples:
        raise GigatronError(
            f'--valid-data {path}: holds no passages; LAMBADA files have one {{"text": ...}} '
            "per line"
        )
    return samples


def passage_text(path: str, number: int, line: str) -> str:
    """The 'text' string of one JSON line, or a clear error."""
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError) as error:
        raise GigatronError(
            f"--valid-data {path}: line {number} is not a JSON object with 'text' "
            f'({error}); LAMBADA files have one {{"text": ...}} per line'
        ) from None
    if not isinstance(text, str) or not text.split():
        raise GigatronError(
            f"--valid-data {path}: line {number}: 'text' is {text!r}, not a passage; give "
            "the passage as a non-empty JSON string"
        )
    return text
