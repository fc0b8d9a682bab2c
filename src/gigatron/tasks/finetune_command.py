"""`gigatron finetune`: its flags, parsed before the torch-heavy fine-tuning module is imported
(a quick --help); the run is tasks/finetune.py's."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gigatron.config.parser import FlagParser
from gigatron.config.root import add_config_arguments
from gigatron.config.tasks import FinetuneTaskConfig, add_task_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="gigatron finetune",
        description="fine-tune a BERT checkpoint on MNLI, QQP or RACE",
        allow_abbrev=False,
    )
    add_config_arguments(parser)
    add_task_arguments(parser, FinetuneTaskConfig)
    return parser


def main(argv: Sequence[str]) -> int:
    build_parser().parse_args(list(argv))  # --help and unknown flags end here, before torch
    from gigatron.tasks import finetune  # why: torch-heavy; imported once the flags parse

    return finetune.main(argv)
