"""MoE checkpoints at expert-parallel size 2 (2 processes, distributed optimizer, expert bias):
one file per expert-parallel rank, an exact resume, and `convert-checkpoint` to ep = 1 (and back
to ep = 2) evaluating to the same test loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import helpers
from gigatron.checkpoint.convert import convert_checkpoint
from gigatron.errors import GigatronError
from helpers import gigatron_runs, pretrain, records, tiny_gpt_flags
from helpers import loss_on_test_split as _test_loss

MOE = [
    *tiny_gpt_flags(vocab_size=64, hidden_size=32), "--make-vocab-size-divisible-by", "32",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1",
    "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0", "--deterministic-mode",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", "4", "--moe-router-topk",
    "2", "--moe-layer-freq", "[1,0]", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.001",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
    "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
]  # fmt: skip
EP2 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
WEIGHTS_ONLY = [*helpers.WEIGHTS_ONLY, "--train-iters", "4"]


def _pretrain(*flags: str, nproc: int = 1) -> None:
    pretrain("gpt", *MOE, *flags, nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """4 iterations at ep = 2 saved every 2, and the same run resumed from iteration 2."""
    root = tmp_path_factory.mktemp("moe_ckpt")
    flags = ["pretrain", "gpt", *MOE, *EP2, "--train-iters", "4"]
    gigatron_runs(root, {  # in turn, in one launch
        "full": (2, [*flags, "--save-interval", "2", "--save", str(root / "full")]),
        "resumed": (2, [*flags, "--load", str(root / "full"), "--ckpt-step", "2",
                        "--save", str(root / "resumed")]),
    })  # fmt: skip
    return root


def test_one_file_per_expert_parallel_rank(runs):
    iteration = runs / "full" / "iter_0000004"
    names = sorted(p.name for p in iteration.iterdir() if p.is_dir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001"]
    assert (iteration / "checksums.json").is_file()  # the files' integrity record
    states = [
        torch.load(iteration / name / "model_optim_rng.pt", weights_only=True) for name in names
    ]
    experts = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    shapes = [tuple(s["model"][experts].shape) for s in states]
    assert shapes == [(2, 128, 32), (2, 128, 32)]  # 2 of the 4 experts each, [gate; up] of 64
    assert not torch.equal(states[0]["model"][experts], states[1]["model"][experts])
    bias = "decoder.layers.0.mlp.router.expert_bias"
    assert torch.equal(states[0]["model"][bias], states[1]["model"][bias])
    # Moved by the updates (they may swing back to 0, so look at both saved iterations).
    early = torch.load(
        runs / "full" / "iter_0000002" / names[0] / "model_optim_rng.pt", weights_only=True
    )
    assert early["model"][bias].abs().sum() + states[0]["model"][bias].abs().sum() > 0
    for name in names:
        assert (iteration / name / "distrib_optim.pt").is_file()


def test_resume_is_exact(runs):
    full = {r["iteration"]: r for r in records(runs / "full", "train")}
    resumed = {r["iteration"]: r for r in records(runs / "resumed", "train")}
    assert sorted(resumed) == [3, 4]
    keys = ("lm_loss", "seq_load_balancing_loss", "z_loss", "load_imbalance", "grad_norm")
    for iteration in (3, 4):
        for key in keys:
            assert resumed[iteration][key] == full[iteration][key], (iteration, key)


def test_convert_to_ep1_and_back(runs):
    ep1 = runs / "ep1"
    convert_checkpoint(runs / "full", ep1, target_tp=1, target_pp=1, target_ep=1)
    (name,) = [p.name for p in (ep1 / "iter_0000004").iterdir()]
    assert name == "mp_rank_00"
    state = torch.load(ep1 / "iter_0000004" / name / "model_optim_rng.pt", weights_only=True)
    experts = state["model"]["decoder.layers.0.mlp.experts.linear_fc1.weight"]
    source = [
        torch.load(runs / "full" / "iter_0000004" / d / "model_optim_rng.pt", weights_only=True)
        for d in ("mp_rank_00_000", "mp_rank_00_001")
    ]
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert torch.equal(experts, torch.cat([s["model"][key] for s in source]))
    assert state["args"]["parallel"]["expert_model_parallel_size"] == 1
    metrics = runs / "ep1_metrics.jsonl"
    _pretrain("--load", str(ep1), *WEIGHTS_ONLY, "--metrics-file", str(metrics))
    expected = _test_loss(runs / "full" / "metrics.jsonl")
    assert _test_loss(metrics) == pytest.approx(expected, abs=1e-6)

    back = runs / "ep2_again"
    convert_checkpoint(ep1, back, target_tp=1, target_pp=1, target_ep=2)
    for rank in range(2):
        again = torch.load(
            back / "iter_0000004" / f"mp_rank_00_00{rank}" / "model_optim_rng.pt",
            weights_only=True,
        )
        for key, value in source[rank]["model"].items():
            assert torch.equal(again["model"][key], value), key

    with pytest.raises(GigatronError, match="pick a divisor of --num-experts"):
        convert_checkpoint(runs / "full", runs / "bad", target_tp=1, target_pp=1, target_ep=3)
