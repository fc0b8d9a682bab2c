"""`gigatron convert --from hf` on malformed or hostile folders: each is refused with a message
naming the file and the fix (exit 2, no traceback), and no --save folder or `release.tmp` is
left behind. Among them: an index file whose shard paths leave the model folder."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from gigatron.cli import main as gigatron


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "hf"
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def _edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    path.write_text(change(path.read_text()))


def _set_n_head(text: str) -> str:
    return json.dumps(dict(json.loads(text), n_head=-4))


def _header_bytes(folder: Path) -> tuple[bytes, int]:
    data = (folder / "model.safetensors").read_bytes()
    return data, struct.unpack("<Q", data[:8])[0]


def _rewrite_weights(folder: Path, change) -> None:
    data, length = _header_bytes(folder)
    (folder / "model.safetensors").write_bytes(change(data, length))


def _past_the_end(data: bytes, length: int) -> bytes:
    header = json.loads(data[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"][1] = len(data) * 4
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


def _index(folder: Path, shard: str) -> None:
    """An index file that sends one tensor to `shard` (the rest to the real file)."""
    data, length = _header_bytes(folder)
    names = [n for n in json.loads(data[8 : 8 + length]) if n != "__metadata__"]
    weight_map = {name: "model.safetensors" for name in names}
    weight_map[names[0]] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _modules(folder: Path, text: str) -> None:
    """A sentence-transformers folder: modules.json names where the model is."""
    (folder / "config.json").unlink()
    (folder / "modules.json").write_text(text)


_LEAVING = [{"path": "../../hf", "type": "sentence_transformers.models.Transformer"}]

CASES = {
    "config truncated": (
        lambda f: _edit_config(f, lambda t: t[: len(t) // 2]),
        ["config.json", "not valid JSON"],
    ),
    "config a list": (lambda f: _edit_config(f, lambda t: "[1, 2]"), ["config.json", "list"]),
    "negative heads": (
        lambda f: _edit_config(f, _set_n_head),
        ["config.json", "num_attention_heads -4", "positive"],
    ),
    "garbage header": (
        lambda f: _rewrite_weights(f, lambda d, n: d[:8] + b"\xff" * n + d[8 + n :]),
        ["model.safetensors", "not JSON"],
    ),
    "header claims 2^62 bytes": (
        lambda f: _rewrite_weights(f, lambda d, n: struct.pack("<Q", 2**62) + d[8:]),
        ["model.safetensors", f"claims {2**62} bytes"],
    ),
    "offsets past the end": (
        lambda f: _rewrite_weights(f, _past_the_end),
        ["model.safetensors", "past the end of the file"],
    ),
    "truncated data": (
        lambda f: _rewrite_weights(f, lambda d, n: d[: 8 + n + 100]),
        ["model.safetensors", "past the end of the file"],
    ),
    "truncated header": (
        lambda f: _rewrite_weights(f, lambda d, n: d[: 8 + n // 2]),
        ["model.safetensors", "the header claims"],
    ),
    "shard outside the folder": (
        lambda f: _index(f, "../../../../etc/passwd"),
        ["model.safetensors.index.json", "../../../../etc/passwd", "outside"],
    ),
    "absolute shard path": (
        lambda f: _index(f, "/etc/passwd"),
        ["model.safetensors.index.json", "/etc/passwd", "outside"],
    ),
    "index not JSON": (
        lambda f: (f / "model.safetensors.index.json").write_text("{"),
        ["model.safetensors.index.json", "not an index file"],
    ),
    "modules.json not JSON": (
        lambda f: _modules(f, "{"),
        ["modules.json", "names no sentence_transformers.models.Transformer module"],
    ),
    "modules.json leaving the folder": (
        lambda f: _modules(f, json.dumps(_LEAVING)),
        ["modules.json", "'../../hf' leaves", "refused"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("save_exists", [False, True])
def test_malformed_input_is_refused_and_leaves_nothing(tmp_path, capsys, good, case, save_exists):
    folder = tmp_path / "hf"
    shutil.copytree(good, folder)
    damage, expected = CASES[case]
    damage(folder)
    save = tmp_path / "out"
    if save_exists:
        save.mkdir()
    code = gigatron(
        ["convert", "--from", "hf", "--to", "gigatron", "--load", str(folder), "--save", str(save)]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(folder) in err
    for text in expected:
        assert text in err, err
    assert list(save.iterdir()) == [] if save_exists else not save.exists()


def test_shard_outside_the_folder_is_never_opened(tmp_path, good):
    """The command itself (a fresh process): a readable file outside the folder, named by the
    index, is refused before it is read, without a traceback."""
    folder = tmp_path / "models" / "hf"
    shutil.copytree(good, folder)
    secret = tmp_path / "secret.safetensors"
    shutil.copy(good / "model.safetensors", secret)  # valid: only the path check can refuse it
    _index(folder, "../../secret.safetensors")
    done = subprocess.run(
        [sys.executable, "-m", "gigatron.cli", "convert", "--from", "hf", "--to", "gigatron",
         "--load", str(folder), "--save", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "../../secret.safetensors" in done.stderr and "outside" in done.stderr
    assert not (tmp_path / "out").exists()
