"""Runs several `gigatron` commands one after another in this process; under torchrun, all in
one process group created once (a command finds it and leaves it), so several configurations
cost one launch. Started by helpers.gigatron_sequence with a JSON file of
[[stdout file, [command, args...]], ...]: each command's standard output goes to its file."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from gigatron.cli import main


def run_all(runs: list[tuple[str, list[str]]]) -> int:
    """0 when every command exits 0; else the first failure's exit status, its output on stderr."""
    for stdout_file, args in runs:
        with open(stdout_file, "a", encoding="utf-8") as out, contextlib.redirect_stdout(out):
            code = main(args)
        if code != 0:
            print(f"exit {code}: gigatron {' '.join(args)}", file=sys.stderr)
            print(Path(stdout_file).read_text(encoding="utf-8"), file=sys.stderr)
            return code
        if dist.is_initialized():
            dist.barrier()  # the next command starts after every rank ended this one
    return 0


if __name__ == "__main__":
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        # A rank that fails alone leaves the others waiting: they give up after 5 minutes.
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    try:
        status = run_all(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
    finally:
        if distributed:
            dist.destroy_process_group()
    sys.exit(status)
