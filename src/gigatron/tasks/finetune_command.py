"""`gigatron finetune`: its flags, parsed before the torch-heavy fine-tuning module is imported
(a quick --help); the run is tasks/finetune.py's."""

from __future__ import annotations

from collections.abc import Sequence

from gigatron.config.tasks import build_finetune_parser as build_parser


def main(argv: Sequence[str]) -> int:
    build_parser().parse_args(list(argv))  # --help and unknown flags end here, before torch
    from gigatron.tasks import finetune  # why: torch-heavy; imported once the flags parse

    return finetune.main(argv)
