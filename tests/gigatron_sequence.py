"""Runs several `gigatron` commands one after another in this process; under torchrun, all in
the one launch (each command gets a fresh process group on a store shared by the launch, as a
command destroys the group it ran in), so several configurations cost one launch. Started by
helpers.gigatron_sequence with a JSON file of [[stdout file, [command, args...]], ...]: each
command's standard output goes to its file."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from gigatron.cli import main


def join_process_group(store: dist.Store | None, index: int) -> None:
    """Create the default process group for command `index` unless one exists (a rank that
    fails alone leaves the others waiting: they give up after 5 minutes)."""
    if store is None or dist.is_initialized():
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"command{index}", store), rank=rank,
        world_size=world_size, timeout=datetime.timedelta(minutes=5),
    )  # fmt: skip


def run_all(runs: list[tuple[str, list[str]]], store: dist.Store | None) -> int:
    """0 when every command exits 0; else the first failure's exit status, its output on stderr."""
    for index, (stdout_file, args) in enumerate(runs):
        join_process_group(store, index)
        with open(stdout_file, "a", encoding="utf-8") as out, contextlib.redirect_stdout(out):
            code = main(args)
        if code != 0:
            print(f"exit {code}: gigatron {' '.join(args)}", file=sys.stderr)
            print(Path(stdout_file).read_text(encoding="utf-8"), file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    spec = Path(sys.argv[1])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # One file store per launch (the spec's name is unique): the commands' groups meet there.
    store = dist.FileStore(f"{spec}.store", world_size) if world_size > 1 else None
    try:
        status = run_all(json.loads(spec.read_text(encoding="utf-8")), store)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)
