"""Checkpoint integrity: a SHA-256 of every file of an iteration, recorded at save and checked at
load (`--no-verify-checkpoint` skips the check).

`<iter_dir>/checksums.json` = {"algorithm": "sha256", "files": {relative path: {"size": bytes,
"sha256": hex}}} is written into the `.tmp` directory after every rank finished writing and
before the directory is published, so a published checkpoint always carries it. Both saving and
loading split the files over the ranks (rank r hashes files r, r + world, ...: the hashing of a
large checkpoint runs in parallel, streamed in 8 MiB blocks) and agree on the result with one
gather, so every rank raises the same error. A checkpoint without the file (Megatron-LM's, or
one written before this check existed) loads unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext

MANIFEST = "checksums.json"
ALGORITHM = "sha256"
_BLOCK = 8 << 20
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, read in blocks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _listing(directory: Path) -> list[str]:
    """Every regular file under `directory` (relative, sorted), the manifest left out."""
    return sorted(
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file() and path.name != MANIFEST
    )


def _gather(value: Any, pctx: ParallelContext) -> list[Any]:
    """`value` of every rank (in rank order) on every rank."""
    if pctx.world_size == 1 or not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * pctx.world_size
    dist.all_gather_object(values, value)
    return values


def _shared_listing(directory: Path, pctx: ParallelContext) -> list[str]:
    """Rank 0's listing of `directory`, on every rank (the point after which it is complete)."""
    listing = [_listing(directory) if pctx.rank == 0 else None]
    if pctx.world_size > 1 and dist.is_initialized():
        dist.broadcast_object_list(listing, src=0)
    return listing[0]


def write_manifest(directory: Path, pctx: ParallelContext) -> None:
    """Record the size and SHA-256 of every file of `directory` (collective: call it on every
    rank once all files are written; rank 0 writes the manifest)."""
    directory = Path(directory)
    names = _shared_listing(directory, pctx)
    mine = {
        name: {"size": (directory / name).stat().st_size, ALGORITHM: file_digest(directory / name)}
        for name in names[pctx.rank :: pctx.world_size]
    }
    files: dict[str, Any] = {}
    for part in _gather(mine, pctx):
        files.update(part)
    if pctx.rank == 0:
        manifest = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, directory / MANIFEST)


def read_manifest(iteration_dir: Path) -> dict[str, dict[str, Any]] | None:
    """relative path -> {size, sha256} of a checkpoint, or None when it records none."""
    path = iteration_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"not a {ALGORITHM} manifest")
        return files
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GigatronError(
            f"{path}: unreadable checksum list ({exc}); the checkpoint is damaged: "
            f"{earlier_hint(iteration_dir)}"
        ) from None


def file_problem(iteration_dir: Path, name: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with one recorded file (missing, truncated or grown, changed), or None."""
    path = iteration_dir / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected.get("size"):
        return f"{path} has {size} bytes, {expected.get('size')} were saved (truncated or replaced)"
    if file_digest(path) != expected.get(ALGORITHM):
        return f"{path} does not match its saved {ALGORITHM} checksum (corrupt or replaced)"
    return None


def _looks_complete(iteration_dir: Path) -> bool:
    """Every recorded file is there at its size (no hashing: a cheap check for the hint)."""
    try:
        files = read_manifest(iteration_dir)
    except GigatronError:
        return False
    if files is None:
        return any(iteration_dir.iterdir())
    return all(
        (iteration_dir / name).is_file() and (iteration_dir / name).stat().st_size == e.get("size")
        for name, e in files.items()
    )


def previous_complete(iteration_dir: Path) -> int | None:
    """The newest iteration before `iteration_dir`'s in the same folder that looks complete."""
    match = _ITERATION_DIR.match(iteration_dir.name)
    limit = int(match.group(1)) if match else None
    found = []
    for entry in iteration_dir.parent.iterdir():
        other = _ITERATION_DIR.match(entry.name)
        if other and entry.is_dir() and (limit is None or int(other.group(1)) < limit):
            found.append((int(other.group(1)), entry))
    for iteration, entry in sorted(found, reverse=True):
        if _looks_complete(entry):
            return iteration
    return None


def earlier_hint(iteration_dir: Path) -> str:
    """Where to turn when `iteration_dir` is damaged: the previous complete iteration."""
    earlier = previous_complete(iteration_dir)
    if earlier is None:
        return "no earlier complete checkpoint is in that folder"
    return f"load the previous complete checkpoint with --ckpt-step {earlier}"


def verify_checkpoint(iteration_dir: Path, pctx: ParallelContext) -> None:
    """Check every recorded file of a checkpoint against its size and checksum (collective;
    every rank raises the same GigatronError naming the damaged files)."""
    iteration_dir = Path(iteration_dir)
    files = read_manifest(iteration_dir)
    if files is None:
        return
    names = sorted(files)[pctx.rank :: pctx.world_size]
    mine = [p for p in (file_problem(iteration_dir, n, files[n]) for n in names) if p is not None]
    problems = sorted(p for part in _gather(mine, pctx) for p in part)
    if not problems:
        return
    more = f" (and {len(problems) - 1} other file(s))" if len(problems) > 1 else ""
    raise GigatronError(
        f"{problems[0]}{more}: the checkpoint is damaged; {earlier_hint(iteration_dir)}, or "
        "pass --no-verify-checkpoint to load it unchecked"
    )
