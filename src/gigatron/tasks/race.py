"""RACE (Megatron's tasks/race): reading comprehension with four answer choices, from the
original layout (one JSON article per `*.txt` file with `article`, `questions`, `options`,
`answers`). Each question gives one sample of four `[CLS] question+option [SEP] article [SEP]`
rows; the label is the answer's index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gigatron.data.json_lines import json_lines
from gigatron.errors import GigatronError
from gigatron.tasks.glue import clean_text, make_sample, pair_ids
from gigatron.tasks.text_files import read_utf8

NUM_CHOICES = 4
MAX_QA_LENGTH = 128


def join_question(question: str, option: str) -> str:
    """A question with a blank ('_') gets the option in the blank; else the option follows."""
    return question.replace("_", option) if "_" in question else f"{question} {option}"


def article_samples(data: dict, tokenizer, seq_length: int, where: str) -> list[dict[str, Any]]:
    try:
        article, questions = data["article"], data["questions"]
        options, answers = data["options"], data["answers"]
    except (KeyError, TypeError):
        raise GigatronError(
            f"{where}: not a RACE article (a JSON object with article, questions, options, answers)"
        ) from None
    if not len(questions) == len(options) == len(answers):
        raise GigatronError(f"{where}: questions, options and answers differ in number")
    context = tokenizer.tokenize(clean_text(article))
    samples = []
    for question, choices, answer in zip(questions, options, answers):
        label = ord(answer) - ord("A")
        if len(choices) != NUM_CHOICES or not 0 <= label < NUM_CHOICES:
            raise GigatronError(f"{where}: each question needs 4 options and an answer A-D")
        rows = []
        for option in choices:
            qa = tokenizer.tokenize(clean_text(join_question(question, option)))[:MAX_QA_LENGTH]
            rows.append(
                pair_ids(qa, context, seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad)
            )
        samples.append(make_sample(rows, label))
    return samples


def race_samples(path: str, tokenizer, seq_length: int) -> list[dict[str, Any]]:
    """Every `*.txt` article under `path` (a directory such as RACE/train/high, or one holding
    such directories), in sorted file order."""
    root = Path(path)
    if not root.is_dir():
        raise GigatronError(
            f"{path}: not a directory; RACE data is a directory of article files (RACE/dev/high)"
        )
    files = sorted(root.rglob("*.txt"))
    if not files:
        raise GigatronError(f"{path}: holds no *.txt article files")
    samples = []
    for file in files:
        lines = read_utf8(str(file), "a RACE article file").splitlines()
        for number, data in json_lines(lines, str(file)):
            samples += article_samples(data, tokenizer, seq_length, f"{file}:{number}")
    return samples
