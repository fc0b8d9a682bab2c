"""LAMBADA (Megatron's task): predict the last word of each passage; a passage counts as right
when the greedy (arg-max) prediction of every target token is the target."""

from __future__ import annotations

import json

import numpy as np

from gigatron.errors import GigatronError
from gigatron.tasks.scoring import Sample


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
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as error:
                raise GigatronError(
                    f"--valid-data {path}: line {number} is not a JSON object with 'text' "
                    f'({error}); LAMBADA files have one {{"text": ...}} per line'
                ) from None
            context, target = split_passage(text, tokenizer, strict)
            if not context:
                raise GigatronError(
                    f"--valid-data {path}: line {number} has no context before its last word"
                )
            samples.append(passage_sample(context, target, seq_length))
    return samples
