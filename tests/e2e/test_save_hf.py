"""`--save-hf` at tensor parallel 2 x pipeline parallel 2 (and a Mixtral-shaped MoE at expert
parallel 2 x pipeline parallel 2): a transformers folder at every --save-interval and at the
end, whose transformers logits equal gigatron's for the checkpoint saved at the same iteration
(read back at one process) within 1e-5."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from gigatron.inference.load import load_for_inference
from helpers import NO_DROPOUT, gigatron_runs, tiny_gpt_flags

pytestmark = pytest.mark.distributed

LLAMA = [
    *tiny_gpt_flags(), "--padded-vocab-size", "128", "--group-query-attention",
    "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--global-batch-size", "4", "--num-workers", "0",
    "--eval-iters", "1", "--eval-interval", "10", "--train-iters", "5", "--save-interval", "3",
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
    args = Namespace(
        load=str(load), ckpt_step=step, device="cpu", tokenizer_model=None, vocab_file=None,
        merge_file=None, lora_checkpoint=None,
    )  # fmt: skip
    (model,) = load_for_inference(args).chunks
    with torch.no_grad():
        output = model(TOKENS, torch.arange(TOKENS.shape[1]).unsqueeze(0))
    return output[..., :128].float()


def _hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM  # why: heavy, only these tests need it

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_hf_folders_give_gigatron_logits(runs, layout):
    hf = runs / layout / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["iter_0000003", "iter_0000005"]
    expected_type = "mixtral" if layout.startswith("moe") else "llama"
    for step in (3, 5):
        folder = hf / f"iter_{step:07d}"
        assert json.loads((folder / "config.json").read_text())["model_type"] == expected_type
        expected = _gigatron_logits(runs / layout / "ckpt", step)
        torch.testing.assert_close(_hf_logits(folder), expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(_hf_logits(hf / "iter_0000003"), _hf_logits(hf / "iter_0000005"))
