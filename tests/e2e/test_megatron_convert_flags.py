"""`gigatron convert-checkpoint` with Megatron-LM's tools/checkpoint/convert.py flags: the README
command re-splits a checkpoint (weights equal to the original when the shards are put back
together), `--ckpt-convert-format` output converts too, and each `--loader`/`--saver`/
`--model-type` means what it means in Megatron."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.convert import main as convert_main
from gigatron.checkpoint.megatron_convert import gigatron_to_megatron
from gigatron.checkpoint.megatron_format import model_to_gigatron
from gigatron.errors import GigatronError

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "ckpt-fixtures"
ORIGINAL = FIXTURES / "torch" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
TP2_PP2 = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]


def _original() -> dict[str, torch.Tensor]:
    return torch.load(ORIGINAL, map_location="cpu", weights_only=True)["model"]


def _put_together(iteration_dir: Path, rename=None) -> dict[str, torch.Tensor]:
    """Full tensors from the rank files: tp shards concatenated along the dimension where they
    are smaller than the original, pipeline stages united (names carry global layer numbers)."""
    original = _original()
    original["output_layer.weight"] = original["embedding.word_embeddings.weight"]
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for directory in sorted(iteration_dir.iterdir()):
        tp_rank = int(RANK_DIR.match(directory.name).group(1))
        model = torch.load(directory / "model_optim_rng.pt", weights_only=False)["model"]
        for name, tensor in (rename(model) if rename else model).items():
            shards.setdefault(name, {})[tp_rank] = tensor
    full = {}
    for name, parts in shards.items():
        pieces = [parts[r] for r in sorted(parts)]
        dims = [d for d in range(pieces[0].dim()) if pieces[0].shape[d] != original[name].shape[d]]
        full[name] = torch.cat(pieces, dims[0]) if dims else pieces[0]
        if not dims:
            assert all(torch.equal(p, pieces[0]) for p in pieces), name  # replicated: equal
    return full


def _assert_same_weights(full: dict[str, torch.Tensor]) -> None:
    original = _original()
    # The tied output weight lives on the last stage at pp 2, as a copy of the embedding.
    assert torch.equal(
        full.pop("output_layer.weight"), original["embedding.word_embeddings.weight"]
    )
    assert set(full) == set(original)
    for name, tensor in original.items():
        assert torch.equal(full[name], tensor), name


def _layout(iteration_dir: Path) -> list[str]:
    return sorted(p.name for p in iteration_dir.iterdir())


def test_megatron_readme_command_resplits_the_weights(tmp_path: Path):
    command = [
        sys.executable, "-m", "gigatron.cli", "convert-checkpoint", "--model-type", "GPT",
        "--loader", "core", "--saver", "core", "--load-dir", str(FIXTURES / "torch"),
        "--save-dir", str(tmp_path / "B"), *TP2_PP2,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    iteration_dir = tmp_path / "B" / "iter_0000002"
    assert (tmp_path / "B" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert _layout(iteration_dir) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
    ]  # fmt: skip
    _assert_same_weights(_put_together(iteration_dir))


def test_convert_on_load_output_converts_from_torch_dist(tmp_path: Path):
    """Megatron's `--ckpt-convert-format torch_dist --ckpt-convert-save`, then convert-checkpoint
    reads the torch_dist checkpoint it wrote."""
    flags = (FIXTURES / "README.md").read_text().split("gigatron pretrain gpt ")[1]
    flags = flags.split(" --ckpt-format")[0].replace("\\\n", " ").split()
    dist = tmp_path / "dist"
    command = [
        sys.executable, "-m", "gigatron.cli", "pretrain", "gpt", *flags, "--load",
        str(FIXTURES / "torch"), "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save",
        str(dist),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (dist / "iter_0000002" / "metadata.json").is_file()
    convert_main(["--load-dir", str(dist), "--save-dir", str(tmp_path / "B"), *TP2_PP2])
    _assert_same_weights(_put_together(tmp_path / "B" / "iter_0000002"))


def test_loaders_savers_and_model_type(tmp_path: Path):
    megatron = tmp_path / "megatron"
    gigatron_to_megatron(FIXTURES / "torch", megatron, None, False, log=lambda text: None)
    with pytest.raises(GigatronError, match="written by Megatron-LM .* pass --loader core"):
        convert_main(["--load", str(megatron), "--save", str(tmp_path / "x"), *TP2_PP2])
    convert_main(["--loader", "core", "--load-dir", str(megatron), "--save-dir",
                  str(tmp_path / "core"), *TP2_PP2])  # fmt: skip
    _assert_same_weights(_put_together(tmp_path / "core" / "iter_0000002"))

    # --saver legacy: Megatron-LM's own files (argparse arguments, Megatron-LM's names)
    convert_main(["--saver", "legacy", "--load-dir", str(FIXTURES / "torch"), "--save-dir",
                  str(tmp_path / "legacy"), *TP2_PP2])  # fmt: skip
    iteration_dir = tmp_path / "legacy" / "iter_0000002"
    saved = torch.load(iteration_dir / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert isinstance(saved["args"], argparse.Namespace)
    assert saved["args"].tensor_model_parallel_size == 2
    _assert_same_weights(_put_together(iteration_dir, rename=model_to_gigatron))

    # legacy model-class names it does not know (core names under language_model.) are named
    path = megatron / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"] = {f"language_model.{k}": v for k, v in state["model"].items()}
    torch.save(state, path)
    with pytest.raises(GigatronError, match="holds language_model.decoder.layers.0.input_"):
        convert_main(["--loader", "legacy", "--load-dir", str(megatron), "--save-dir",
                      str(tmp_path / "old")])  # fmt: skip

    with pytest.raises(GigatronError, match="holds a gpt model, not bert"):
        convert_main(["--model-type", "BERT", "--load-dir", str(FIXTURES / "torch"),
                      "--save-dir", str(tmp_path / "bert")])  # fmt: skip
    with pytest.raises(GigatronError, match="has no config.json"):
        convert_main(["--loader", "llama_mistral", "--load-dir", str(FIXTURES / "torch"),
                      "--save-dir", str(tmp_path / "hf")])  # fmt: skip
