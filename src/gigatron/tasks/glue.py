"""GLUE sentence-pair tasks (Megatron's tasks/glue): MNLI and QQP read from GLUE's TSV files and
turned into `[CLS] a [SEP] b [SEP]` samples padded to the sequence length.

A sample is a dict of numpy arrays: `tokens`, `token_types`, `padding_mask` (1 real, 0 pad;
int64 `[seq]`) and `label` (int64 scalar). Multiple-choice tasks (RACE) stack one row per choice."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from gigatron.errors import GigatronError
from gigatron.tasks.text_files import read_utf8

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
QQP_LABELS = {"0": 0, "1": 1}
NUM_CLASSES = {"MNLI": 3, "QQP": 2}


def clean_text(text: str) -> str:
    """Megatron's clean-up: newlines and runs of white space become one space; ' . ' -> '. '."""
    text = re.sub(r"\s+", " ", text.replace("\n", " "))
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def pair_ids(
    first: Sequence[int],
    second: Sequence[int] | None,
    seq_length: int,
    cls: int,
    sep: int,
    pad: int,
) -> tuple[list[int], list[int], list[int]]:
    """(tokens, token types, padding mask) of `[CLS] first [SEP] second [SEP]`, Megatron's rule:
    a pair too long keeps its first `seq_length - 1` tokens and ends with [SEP]; padding has
    token type `pad` and mask 0."""
    ids = [cls, *first, sep]
    types = [0] * len(ids)
    if second is not None:
        ids += list(second)
        types += [1] * len(second)
    trimmed = len(ids) >= seq_length
    if trimmed:
        ids, types = ids[: seq_length - 1], types[: seq_length - 1]
    if second is not None or trimmed:
        ids.append(sep)
        types.append(0 if second is None else 1)
    mask = [1] * len(ids)
    missing = seq_length - len(ids)
    return ids + [pad] * missing, types + [pad] * missing, mask + [0] * missing


def make_sample(rows: list[tuple[list[int], list[int], list[int]]], label: int) -> dict[str, Any]:
    """One sample; several rows (choices) are stacked as `[choices, seq]`."""
    arrays = [np.asarray([row[i] for row in rows], dtype=np.int64) for i in range(3)]
    if len(rows) == 1:
        arrays = [a[0] for a in arrays]
    tokens, types, mask = arrays
    return {
        "tokens": tokens,
        "token_types": types,
        "padding_mask": mask,
        "label": np.asarray(label, dtype=np.int64),
    }


def _rows(path: str) -> list[list[str]]:
    text = read_utf8(path, "a GLUE TSV file")
    return [line.strip().split("\t") for line in text.splitlines() if line.strip()]


def read_mnli(path: str) -> list[tuple[str, str, int]]:
    """(sentence1, sentence2, label) of a GLUE MNLI file (columns 8, 9 and the last; a test file,
    10 columns without labels, gets the label 'contradiction' as in Megatron)."""
    rows = _rows(path)
    if not rows:
        raise GigatronError(f"{path}: empty; MNLI files have a header and one pair per line")
    is_test = len(rows[0]) == 10
    pairs = []
    for number, row in enumerate(rows[1:], 2):
        label = "contradiction" if is_test else row[-1].strip()
        if len(row) < 10 or label not in MNLI_LABELS:
            raise GigatronError(
                f"{path}: line {number} is not an MNLI row (sentence1 and sentence2 in columns "
                f"9 and 10, a label of {sorted(MNLI_LABELS)} last)"
            )
        pairs.append((clean_text(row[8].strip()), clean_text(row[9].strip()), MNLI_LABELS[label]))
    return pairs


def read_qqp(path: str) -> list[tuple[str, str, int]]:
    """(question1, question2, label) of a GLUE QQP file: id, qid1, qid2, question1, question2,
    is_duplicate (a test file, id, question1, question2, gets label 0); rows of another width
    or with an empty question are skipped, as in Megatron."""
    rows = _rows(path)
    if not rows:
        raise GigatronError(f"{path}: empty; QQP files have a header and one pair per line")
    is_test = len(rows[0]) == 3
    if not is_test and len(rows[0]) != 6:
        raise GigatronError(
            f"{path}: the header has {len(rows[0])} columns; QQP files have 6 (id, qid1, qid2, "
            "question1, question2, is_duplicate) or 3 (test: id, question1, question2)"
        )
    pairs = []
    for number, row in enumerate(rows[1:], 2):
        if is_test:
            a, b, label = row[1], row[2], "0"
        elif len(row) == 6:
            a, b, label = row[3], row[4], row[5].strip()
        else:
            continue
        a, b = clean_text(a.strip()), clean_text(b.strip())
        if not a or not b:
            continue
        if label not in QQP_LABELS:
            raise GigatronError(f"{path}: line {number} has the label {label!r}; QQP's are 0, 1")
        pairs.append((a, b, QQP_LABELS[label]))
    return pairs


def glue_samples(task: str, path: str, tokenizer, seq_length: int) -> list[dict[str, Any]]:
    pairs = read_mnli(path) if task == "MNLI" else read_qqp(path)
    samples = []
    for a, b, label in pairs:
        row = pair_ids(
            tokenizer.tokenize(a), tokenizer.tokenize(b), seq_length,
            tokenizer.cls, tokenizer.sep, tokenizer.pad,
        )  # fmt: skip
        samples.append(make_sample([row], label))
    return samples
