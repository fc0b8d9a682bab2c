"""Checkpoint integrity (checkpoint/integrity.py): every file's SHA-256 is saved with the
checkpoint and checked at load; a damaged file is named with the previous complete iteration."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_dist_checkpoint import _run, _step

from gigatron.checkpoint import integrity
from gigatron.checkpoint.dist_format import read_full_tensors
from gigatron.checkpoint.formats import load_checkpoint, save_checkpoint
from gigatron.errors import GigatronError


def _saved(tmp_path: Path, ckpt_format: str):
    """Iterations 1 and 2 of a tiny run saved in `ckpt_format`; returns the run's pieces."""
    cfg, pctx, model, optimizer, scheduler = _run(precision="fp32")
    cfg.checkpoint.ckpt_format = ckpt_format
    for iteration in (1, 2):
        _step(model, optimizer, scheduler, iteration)
        save_checkpoint(tmp_path, iteration, [model], optimizer, scheduler, pctx, cfg)
    return cfg, pctx, model, optimizer, scheduler


def _largest(iteration_dir: Path) -> Path:
    files = [p for p in iteration_dir.rglob("*") if p.is_file() and p.name != integrity.MANIFEST]
    return max(files, key=lambda p: p.stat().st_size)


def _flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_every_file_is_recorded_and_damage_is_named(tmp_path: Path, ckpt_format: str):
    cfg, pctx, model, optimizer, scheduler = _saved(tmp_path, ckpt_format)
    iter2 = tmp_path / "iter_0000002"
    recorded = json.loads((iter2 / integrity.MANIFEST).read_text())
    files = [p for p in iter2.rglob("*") if p.is_file() and p.name != integrity.MANIFEST]
    assert sorted(recorded["files"]) == sorted(str(p.relative_to(iter2)) for p in files)
    for path in files:  # sizes and digests are the files' own
        entry = recorded["files"][str(path.relative_to(iter2))]
        assert entry["size"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)["iteration"] == 2

    target = _largest(iter2)
    pristine = target.read_bytes()
    damages = {
        "does not match its saved sha256 checksum": lambda: _flip(target),
        "bytes, .* were saved": lambda: target.write_bytes(pristine[: len(pristine) // 2]),
        "is missing": target.unlink,
        # another iteration's file of the same name: a valid file, but not this checkpoint's
        "does not match|bytes, .* were saved": lambda: shutil.copy(
            tmp_path / "iter_0000001" / target.relative_to(iter2), target
        ),
    }
    for expected, damage in damages.items():
        target.write_bytes(pristine)
        damage()
        with pytest.raises(GigatronError) as caught:
            load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)
        message = str(caught.value)
        assert str(target) in message and "--ckpt-step 1" in message, message
        assert "--no-verify-checkpoint" in message
        assert re.search(expected, message), message
    target.write_bytes(pristine)
    # the previous iteration loads with --ckpt-step, checked too
    earlier = load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg, iteration=1)
    assert earlier["iteration"] == 1


def test_without_verification_flipped_bytes_load_and_a_broken_shard_is_one_line(tmp_path: Path):
    cfg, pctx, model, optimizer, scheduler = _saved(tmp_path, "torch_dist")
    cfg.checkpoint.verify_checkpoint = False  # --no-verify-checkpoint
    iter2 = tmp_path / "iter_0000002"
    shard = max(iter2.glob("*.distcp"), key=lambda p: p.stat().st_size)
    pristine = shard.read_bytes()
    good = read_full_tensors(iter2)
    _flip(shard)
    load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)  # unchecked: loads
    assert any(not torch.equal(v, good[k]) for k, v in read_full_tensors(iter2).items())
    shard.write_bytes(pristine[:100])  # truncated: DCP's failure becomes one line naming it
    with pytest.raises(GigatronError, match=r"iter_0000002: its tensors could not be read") as e:
        load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)
    assert "--ckpt-step 1" in str(e.value) and "Traceback" not in str(e.value)


def test_a_checkpoint_without_checksums_loads_and_a_broken_list_is_named(tmp_path: Path):
    cfg, pctx, model, optimizer, scheduler = _saved(tmp_path, "torch")
    manifest = tmp_path / "iter_0000002" / integrity.MANIFEST
    manifest.write_text("{not json")
    with pytest.raises(GigatronError, match=r"checksums.json: unreadable checksum list.*-step 1"):
        load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)
    manifest.unlink()  # as Megatron-LM (or an older gigatron) writes them: nothing to check
    assert load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)["iteration"] == 2
