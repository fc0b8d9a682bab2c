"""`gigatron generate` and `gigatron serve` (cli.py's entries): inference/generate.py and
inference/serve_command.py with the attach hook that lets a Retro checkpoint generate with
retrieval (`--retro-project-dir`; tasks/retro_retrieval.py, docs/retro.md 5.2). Importing this
module loads no torch, so `--help` stays quick."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gigatron.inference import generate, serve_command


def attach(loaded: Any, args: argparse.Namespace) -> None:
    from gigatron.tasks.retro_retrieval import attach_retrieval  # why: torch after parsing

    attach_retrieval(loaded, args)


def generate_main(argv: Sequence[str]) -> int:
    """`gigatron generate ...` (a Retro checkpoint: `--retro-project-dir DIR`)."""
    return generate.main(argv, attach=attach)


def serve_main(argv: Sequence[str]) -> int:
    """`gigatron serve ...` (a Retro checkpoint: `--retro-project-dir DIR`)."""
    return serve_command.main(argv, attach=attach)
