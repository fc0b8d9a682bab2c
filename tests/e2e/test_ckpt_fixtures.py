"""Checkpoints written by gigatron before the checkpoint-format refactor still load with identical
weights and resume to the losses that code computed (tests/data/ckpt-fixtures/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.formats import FORMATS, detect_format, get_format, load_checkpoint
from gigatron.config.root import parse_config
from gigatron.errors import GigatronError
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.optim.lr_schedule import build_lr_scheduler
from gigatron.parallel.context import ParallelContext

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "ckpt-fixtures"
FLAGS = [
    "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "32",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--optimizer", "sgd", "--sgd-momentum", "0", "--lr", "1e-3",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0",
    "--deterministic-mode", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--seed", "1234",
]  # fmt: skip
# The lm losses of iterations 3 and 4 when the code that wrote the fixtures resumed them.
RESUMED_LOSSES = {3: 4.196434020996094, 4: 4.160521984100342}


def _saved_weights() -> dict[str, torch.Tensor]:
    path = FIXTURES / "torch" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_old_checkpoint_loads_with_identical_weights(fmt: str):
    cfg = parse_config([*FLAGS, "--train-iters", "2", "--ckpt-format", fmt])
    pctx = ParallelContext.single()
    (model,) = build_model(cfg, pctx, vocab_size=64)
    optimizer = build_optimizer(cfg, [model], pctx)
    scheduler = build_lr_scheduler(cfg, optimizer)
    assert detect_format(FIXTURES / fmt / "iter_0000002") == fmt
    loaded = load_checkpoint(FIXTURES / fmt, [model], optimizer, scheduler, pctx, cfg)
    assert (loaded["iteration"], loaded["consumed_train_samples"]) == (2, 8)
    saved = _saved_weights()  # both fixtures come from the same deterministic run
    state = model.state_dict()
    assert set(saved) <= set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_old_checkpoint_resumes_to_the_same_losses(fmt: str, tmp_path: Path):
    load = tmp_path / "load"
    shutil.copytree(FIXTURES / fmt, load)
    save = tmp_path / "save"
    command = [
        sys.executable, "-m", "gigatron.cli", "pretrain", "gpt", *FLAGS, "--train-iters", "4",
        "--override-opt_param-scheduler", "--ckpt-format", fmt, "--load", str(load),
        "--save", str(save),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "loaded checkpoint" in result.stdout + result.stderr
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["lm_loss"] for r in records if r["type"] == "train"}
    assert losses == pytest.approx(RESUMED_LOSSES, rel=1e-6, abs=0)
    assert (save / "iter_0000004").is_dir()


def test_torch_dist_checkpoint_without_metadata_json_names_it(tmp_path: Path):
    load = tmp_path / "load"
    shutil.copytree(FIXTURES / "torch_dist", load)
    (load / "iter_0000002" / "metadata.json").unlink()
    cfg = parse_config([*FLAGS, "--train-iters", "2", "--ckpt-format", "torch_dist"])
    pctx = ParallelContext.single()
    (model,) = build_model(cfg, pctx, vocab_size=64)
    with pytest.raises(GigatronError) as error:
        load_checkpoint(load, [model], None, None, pctx, cfg)
    message = str(error.value)
    assert "holds torch_dist files (.metadata, common.pt, __0_0.distcp)" in message
    assert "metadata.json is missing" in message and "torch-format" not in message


def test_formats_are_registered_and_detected():
    assert [get_format(name).name for name in ("torch", "torch_dist")] == ["torch", "torch_dist"]
    for fmt in ("torch", "torch_dist"):
        assert [f for f in FORMATS if get_format(f).detect(FIXTURES / fmt / "iter_0000002")] == [
            fmt
        ]
    with pytest.raises(GigatronError, match="--ckpt-format zarr: not a checkpoint format"):
        get_format("zarr")
