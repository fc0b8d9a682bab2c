"""Flags of the downstream tasks (Megatron's tasks/main.py): `gigatron evaluate` (zero-shot
WikiText / LAMBADA) and `gigatron finetune` (MNLI, QQP, RACE on a BERT checkpoint). Not a section
of GigatronConfig: only the task commands parse them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import add_dataclass_arguments, flag_field
from gigatron.config.parser import command_parser
from gigatron.config.root import add_config_arguments

ZERO_SHOT_TASKS = ["WIKITEXT103", "LAMBADA", "RETRO-QA"]  # RETRO-QA: tasks/retro_qa.py
FINETUNE_TASKS = ["MNLI", "QQP", "RACE"]


@dataclass
class ZeroShotTaskConfig:
    task: Optional[str] = flag_field(None, "the zero-shot task", choices=ZERO_SHOT_TASKS)
    valid_data: list[str] = flag_field([], "the file to evaluate on", nargs=1)
    overlapping_eval: int = flag_field(
        32, "WIKITEXT103: stride of the sliding window (tokens scored per window after the first)"
    )
    strict_lambada: bool = flag_field(
        False, "LAMBADA: the target is the whole last word (all of its tokens), not its last token"
    )


@dataclass
class FinetuneTaskConfig:
    task: Optional[str] = flag_field(None, "the fine-tuning task", choices=FINETUNE_TASKS)
    train_data: list[str] = flag_field(
        [], "training files (MNLI, QQP: TSV files; RACE: directories of article files)", nargs="+"
    )
    valid_data: list[str] = flag_field([], "validation files or directories; accuracy is reported on each", nargs="*")
    epochs: Optional[int] = flag_field(
        None, "passes over the training data; 0 evaluates the pretrained checkpoint only"
    )
    keep_last: bool = flag_field(False, "train on the last, incomplete global batch of each epoch too")
    eval_micro_batch_size: Optional[int] = flag_field(
        None, "validation samples per forward pass", default_help="--micro-batch-size"
    )


def add_task_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    add_dataclass_arguments(parser, cls, title="task")


def task_config_from_namespace(cls: type, namespace: argparse.Namespace):
    """The task dataclass from parsed flags (defaults where a flag was not given)."""
    config = cls()
    for field in dataclasses.fields(cls):
        if hasattr(namespace, field.name):
            setattr(config, field.name, getattr(namespace, field.name))
    return config


def build_finetune_parser() -> argparse.ArgumentParser:
    """`gigatron finetune`'s flags: every configuration flag and the fine-tuning task's."""
    parser = command_parser(
        "finetune",
        "fine-tune a BERT checkpoint on MNLI, QQP or RACE",
    )
    add_config_arguments(parser)
    add_task_arguments(parser, FinetuneTaskConfig)
    return parser
