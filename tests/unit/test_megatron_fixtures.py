"""gigatron resumes from checkpoints written by Megatron-LM's own save_checkpoint
(tests/data/megatron-fixtures): the losses of the next two steps equal the ones Megatron
recorded, so weights, Adam moments, step count and learning-rate schedule all carried over
(the step-5 loss needs the saved moments: with --no-load-optim it differs)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import TIMEOUT_S, env, launcher
from megatron_fixtures import record, resume

TOLERANCE = 1e-5


def assert_megatron_losses(name: str, losses: dict[int, float]) -> None:
    fixture = record(name)
    assert sorted(losses) == [4, 5]
    assert losses[4] == pytest.approx(fixture["next_loss"], abs=TOLERANCE)
    assert losses[5] == pytest.approx(fixture["loss_after_next_step"], abs=TOLERANCE)


@pytest.mark.parametrize(
    "name",
    [
        "gpt2_tp1_torch",
        "gpt2_tp1_torch_dist",
        "gpt2_dp2_distopt_torch",  # distrib_optim.pt, saved at dp 2
        "gpt2_dp2_distopt_torch_dist",  # dp_reshardable flat buffers, saved at dp 2
        "llama_tp2_torch_dist",  # saved at tp 2, loaded at tp 1
        "moe_tp1_torch",  # experts' moments stacked per layer
        "moe_tp1_torch_dist",  # decoder.layers.mlp.experts.experts.* [layers, experts, ...]
    ],
)
def test_resume_at_tp1_gives_megatrons_next_losses(tmp_path, name):
    flags = ["--ckpt-format", "torch_dist"] if name.endswith("torch_dist") else []
    assert_megatron_losses(name, resume(name, tmp_path, *flags))


def test_moments_matter(tmp_path):
    """Without the saved moments the step after the next one differs: the check above reads them."""
    losses = resume(
        "gpt2_tp1_torch_dist", tmp_path, "--ckpt-format", "torch_dist", "--no-load-optim"
    )
    fixture = record("gpt2_tp1_torch_dist")
    assert losses[4] == pytest.approx(fixture["next_loss"], abs=TOLERANCE)
    assert abs(losses[5] - fixture["loss_after_next_step"]) > 1e-3


@pytest.mark.parametrize(
    "spec",
    [
        "llama_tp2_torch:--tensor-model-parallel-size,2",  # the saved layout
        "gpt2_tp1_torch_dist:--tensor-model-parallel-size,2,--ckpt-format,torch_dist",  # saved at tp 1
    ],
    ids=["llama_tp2_torch", "gpt2_tp1_torch_dist"],
)
def test_resume_at_tp2_gives_megatrons_next_losses(tmp_path, spec):
    """Two processes under torchrun (one resume per launch: a run ends its process group)."""
    out = tmp_path / "losses.json"
    script = Path(__file__).resolve().parents[1] / "megatron_fixtures.py"
    subprocess.run([*launcher(2), str(script), str(out), spec], env=env(), check=True,
                   timeout=TIMEOUT_S, capture_output=True)  # fmt: skip
    ((name, losses),) = json.loads(out.read_text()).items()
    assert name == spec.partition(":")[0]
    assert_megatron_losses(name, {int(k): v for k, v in losses.items()})
