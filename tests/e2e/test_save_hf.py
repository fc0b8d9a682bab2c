"""`--save-hf` at tensor parallel 2 x pipeline parallel 2 (and a Mixtral-shaped MoE at expert
parallel 2 x pipeline parallel 2): a transformers folder at every --save-interval and at the
end, whose transformers logits equal gigatron's for the checkpoint saved at the same iteration
(read back at one process) within 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import NO_DROPOUT, gigatron_runs, tiny_gpt_flags
from hf_helpers import checkpoint_model, transformers_logits

pytestmark = pytest.mark.distributed

LLAMA = [
    *tiny_gpt_flags(), "--padded-vocab-size", "128", "--group-query-attention",
    "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--global-batch-size", "4", "--num-workers", "0",
    "--eval-iters", "1", "--eval-interval", "10", "--train-iters", "3", "--save-interval", "2",
    "--lr", "1e-2", "--ckpt-format", "torch_dist", *NO_DROPOUT,
]  # fmt: skip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-ffn-hidden-size", "32"]  # fmt: skip
LAYOUTS = {
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "moe_ep2pp2": [*MOE, "--pipeline-model-parallel-size", "2"],
}
TOKENS = torch.tensor([[3, 17, 40, 41, 99, 5, 64, 12, 7, 100, 33, 2]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("save_hf")
    gigatron_runs(
        root,
        {
            name: (4, ["pretrain", "gpt", *LLAMA, *flags, "--save", root / name / "ckpt",
                       "--save-hf", root / name / "hf"])
            for name, flags in LAYOUTS.items()
        },
    )  # fmt: skip
    return root


def _gigatron_logits(load: Path, step: int) -> torch.Tensor:
    with torch.no_grad():
        output = checkpoint_model(load, step)(TOKENS, torch.arange(TOKENS.shape[1]).unsqueeze(0))
    return output[..., :128].float()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_hf_folders_give_gigatron_logits(runs, layout):
    hf = runs / layout / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["iter_0000002", "iter_0000003"]
    expected_type = "mixtral" if layout.startswith("moe") else "llama"
    logits = []
    for step in (2, 3):
        folder = hf / f"iter_{step:07d}"
        assert json.loads((folder / "config.json").read_text())["model_type"] == expected_type
        logits.append(transformers_logits(folder, TOKENS))
        expected = _gigatron_logits(runs / layout / "ckpt", step)
        torch.testing.assert_close(logits[-1], expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits[0], logits[1])  # a folder per save: the model trained between
