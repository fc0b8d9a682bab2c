"""`gigatron pretrain mamba`: a hybrid stack trained at tp = 2 with sequence parallelism (2
processes) and saved; `convert-checkpoint` merges the mixer's block-split tensors into full ones
and re-splits them for pp = 2; both evaluate to the source's test loss."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.convert import convert_checkpoint
from helpers import WEIGHTS_ONLY, gigatron, pretrain
from helpers import loss_on_test_split as _test_loss
from helpers import records as read_records

# 64 tokens padded to a multiple of 32 x tp: 64 rows at tp 1 and 2 (same logits in every layout).
TINY = [
    "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "32",
    "--hybrid-layer-pattern", "M*-M", "--hidden-size", "32", "--num-attention-heads", "4",
    "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
    "--num-workers", "0", "--deterministic-mode", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip
D_INNER, BC, HEADS = 64, 2 * 8, 8  # full sizes of in_proj's blocks [z; x; B; C; dt]


def _pretrain(*flags: str, nproc: int = 1) -> subprocess.CompletedProcess:
    return pretrain("mamba", *TINY, *flags, nproc=nproc)


def _model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mamba") / "src"
    _pretrain(
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(directory),
        nproc=2,
    )  # fmt: skip
    return directory


def test_trains_and_reports_the_loss(source):
    train = [r for r in read_records(source) if r["type"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(4.0 < r["lm_loss"] < 4.5 for r in train)  # about log(64) at the start
    assert all(r["tokens_per_s"] > 0 for r in train)


def test_converted_to_tp1_the_mixer_tensors_are_merged_block_by_block(source):
    target = source.parent / "tp1"
    convert_checkpoint(source, target, target_tp=1, target_pp=1)
    shards = [_model(source / f"iter_0000002/mp_rank_0{r}/model_optim_rng.pt") for r in (0, 1)]
    merged = _model(target / "iter_0000002/mp_rank_00/model_optim_rng.pt")
    assert sorted(merged) == sorted(shards[0])
    for layer in (0, 3):  # the two Mamba layers
        name = f"decoder.layers.{layer}.mixer.in_proj.weight"
        local = [D_INNER // 2, D_INNER // 2, BC // 2, BC // 2, HEADS // 2]
        blocks = zip(*(s[name].split(local) for s in shards), strict=True)
        assert torch.equal(merged[name], torch.cat([torch.cat(pair) for pair in blocks]))
        for suffix in ("A_log", "D", "dt_bias", "norm.weight", "conv1d.weight"):
            assert (
                merged[f"decoder.layers.{layer}.mixer.{suffix}"].shape[0]
                == 2 * shards[0][f"decoder.layers.{layer}.mixer.{suffix}"].shape[0]
            )
    metrics = target.parent / "tp1_metrics.jsonl"
    _pretrain("--load", str(target), *WEIGHTS_ONLY, "--metrics-file", str(metrics))
    assert _test_loss(metrics) == pytest.approx(_test_loss(source / "metrics.jsonl"), abs=1e-5)


def test_converted_to_pp2_evaluates_like_the_source(source):
    target = source.parent / "pp2"
    convert_checkpoint(source, target, target_tp=1, target_pp=2)
    first = _model(target / "iter_0000002/mp_rank_00_000/model_optim_rng.pt")
    last = _model(target / "iter_0000002/mp_rank_00_001/model_optim_rng.pt")
    assert "decoder.layers.0.mixer.in_proj.weight" in first  # M*|-M
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in first
    assert "decoder.layers.2.mlp.linear_fc1.weight" in last
    assert "decoder.layers.3.mixer.A_log" in last
    metrics = target.parent / "pp2_metrics.jsonl"
    _pretrain(
        "--pipeline-model-parallel-size", "2", "--load", str(target), *WEIGHTS_ONLY,
        "--metrics-file", str(metrics), nproc=2,
    )  # fmt: skip
    assert _test_loss(metrics) == pytest.approx(_test_loss(source / "metrics.jsonl"), abs=1e-5)


@torch.no_grad()
def _recompute_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))[0, -1, :64]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.distributed
def test_generate_at_tp2_with_the_state_cache_equals_recompute_at_tp1(source, tmp_path):
    prompts = ["5 9 12 3 40 41", "7", "1 2 3 4 5 6 7 8 9 10 11 12 13"]
    output = tmp_path / "out.jsonl"
    gigatron(
        "generate", "--load", str(source), "--device", "cpu",
        "--greedy", "--max-tokens", "8", "--ignore-eos", "--max-batch-size", "2",
        "--max-sequence-length", "32",
        *[item for prompt in prompts for item in ("--prompt", prompt)], "--output", str(output),
        nproc=2,
    )  # fmt: skip
    records = read_records(output)

    from argparse import Namespace

    from gigatron.inference.load import load_for_inference

    target = tmp_path / "tp1"
    convert_checkpoint(source, target, target_tp=1, target_pp=1)
    loaded = load_for_inference(
        Namespace(load=str(target), ckpt_step=None, device="cpu", tokenizer_model=None,
                  vocab_file=None, merge_file=None)
    )  # fmt: skip
    model = loaded.chunks[0]
    for prompt, record in zip(prompts, records):
        ids = [int(t) for t in prompt.split()]
        assert record["tokens"] == _recompute_greedy(model, ids, 8)
