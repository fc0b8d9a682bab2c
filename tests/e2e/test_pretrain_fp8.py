"""`gigatron pretrain gpt` with fp8 (torchao's emulation on CPU) and the loss computed by the
model (`--cross-entropy-loss-fusion`, its PyTorch path on CPU): it trains, saves plain
checkpoints and resumes bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from gigatron.training.pretrain import main as pretrain_main
from helpers import tiny_gpt_flags, train_values

FLAGS = [
    *tiny_gpt_flags(), "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "4",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--deterministic-mode",
    "--bf16", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--cross-entropy-loss-fusion",
]  # fmt: skip


@pytest.fixture
def run():
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def pretrain(*flags: str) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert pretrain_main(["gpt", *FLAGS, *flags]) == 0
        return [str(w.message) for w in caught]

    yield pretrain
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


def test_fp8_pretrain_saves_plain_checkpoints_and_resumes_bitwise(tmp_path, run):
    full, part = tmp_path / "full", tmp_path / "part"
    messages = run("--save", str(full), "--save-interval", "2")
    assert any("torchao emulates the fp8 products" in m for m in messages)
    assert any("--cross-entropy-loss-fusion: fused kernels need a CUDA" in m for m in messages)
    reference = train_values(full)
    assert sorted(reference) == [1, 2, 3, 4] and reference[4] < reference[1]
    state = torch.load(
        full / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True
    )
    weights = state["model"]
    assert weights and all(type(t) is torch.Tensor for t in weights.values() if t is not None)
    run("--save", str(part), "--save-interval", "2", "--exit-interval", "2")
    run("--save", str(part), "--load", str(part))
    resumed = train_values(part)
    assert [resumed[i] for i in (3, 4)] == [reference[i] for i in (3, 4)]
