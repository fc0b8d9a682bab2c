"""A LoRA run's checkpoint out of gigatron, on a Llama-shaped tiny model: `convert --merge-lora`
(a plain gigatron checkpoint, re-split to tp 2, and a Hugging Face folder) gives the logits of the
adapted model; `convert --to peft` loads with `peft` on the transformers model exported from the
base and gives those logits too; `generate --lora-checkpoint` generates with the adapters."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from gigatron.inference.load import load_for_inference
from gigatron.parallel.tensor_parallel import merge_partitions
from gigatron.torch_files import safe_load
from helpers import NO_DROPOUT, gigatron_runs, tiny_gpt_flags

pytestmark = pytest.mark.distributed

LLAMA = [
    *tiny_gpt_flags(), "--padded-vocab-size", "128", "--group-query-attention",
    "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--global-batch-size", "4", "--num-workers", "0",
    "--eval-iters", "1", "--eval-interval", "10", "--train-iters", "10", *NO_DROPOUT,
]  # fmt: skip
LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
        "--lora-rank", "4", "--lora-alpha", "8"]  # fmt: skip
TOKENS = torch.tensor([[3, 17, 40, 41, 99, 5, 64, 12, 7, 100, 33, 2]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora_convert")
    lora = ["--from", "gigatron", "--load", root / "lora"]
    gigatron_runs(
        root,
        {
            "base": (1, ["pretrain", "gpt", *LLAMA, "--lr", "1e-2", "--save", root / "base"]),
            "lora": (1, ["pretrain", "gpt", *LLAMA, *LORA, "--lr", "5e-2", "--save",
                         root / "lora", "--pretrained-checkpoint", root / "base"]),
            "merged": (1, ["convert", *lora, "--to", "gigatron", "--merge-lora", "--save",
                           root / "merged", "--target-tensor-parallel-size", "2"]),
            "merged_hf": (1, ["convert", *lora, "--to", "hf", "--merge-lora", "--save",
                              root / "merged_hf", "--no-tokenizer"]),
            "peft": (1, ["convert", *lora, "--to", "peft", "--save", root / "peft"]),
            "base_hf": (1, ["convert", "--from", "gigatron", "--to", "hf", "--load",
                            root / "base", "--save", root / "base_hf", "--no-tokenizer"]),
            "generate": (1, ["generate", "--load", root / "base", "--lora-checkpoint",
                             root / "lora", "--prompt", "3 17 40 41", "--greedy", "--device", "cpu",
                             "--max-tokens", "6", "--ignore-eos", "--output",
                             root / "generated.jsonl"]),
        },
    )  # fmt: skip
    return root


def _gigatron_logits(load: Path, lora: Path | None = None) -> torch.Tensor:
    args = Namespace(
        load=str(load), ckpt_step=None, device="cpu", tokenizer_model=None, vocab_file=None,
        merge_file=None, lora_checkpoint=str(lora) if lora else None,
    )  # fmt: skip
    loaded = load_for_inference(args)
    (model,) = loaded.chunks
    with torch.no_grad():
        positions = torch.arange(TOKENS.shape[1]).unsqueeze(0)
        return model(TOKENS, positions)[..., :128].float()


@pytest.fixture(scope="module")
def adapted_logits(runs) -> torch.Tensor:
    return _gigatron_logits(runs / "base", runs / "lora")


def test_the_adapters_change_the_model(runs, adapted_logits):
    base = _gigatron_logits(runs / "base")
    assert (adapted_logits - base).abs().max() > 1e-2


def test_merged_checkpoint_gives_the_adapted_logits(runs, adapted_logits):
    # Re-split to tp 2: gather the two files back and compare with the tp-1 merged weights.
    files = [runs / "merged" / "iter_0000010" / f"mp_rank_0{r}" / "model_optim_rng.pt"
             for r in (0, 1)]  # fmt: skip
    parts = [safe_load(f)["model"] for f in files]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert parts[0][name].shape == (64, 64)  # [2 groups x (2 + 2) heads x 16] / tp 2
    merged_qkv = merge_partitions([p[name] for p in parts], 0, 1)
    base_qkv = safe_load(runs / "base" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    assert not torch.equal(merged_qkv, base_qkv["model"][name])
    assert not any("adapter" in key for key in parts[0])
    # The merged model at one process: convert back to tp 1 through the same pipeline.
    from gigatron.checkpoint.pipeline import Target, convert

    single = runs / "merged_tp1"
    convert("gigatron", runs / "merged", "gigatron", single, Target(tp=1))
    torch.testing.assert_close(_gigatron_logits(single), adapted_logits, rtol=1e-5, atol=1e-5)


def _hf_logits(folder: Path, peft: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM  # why: heavy, only these tests need it

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if peft is not None:
        from peft import PeftModel  # why: heavy, only this test needs it

        model = PeftModel.from_pretrained(model, peft)
    model.eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


def test_merged_hugging_face_folder_gives_the_adapted_logits(runs, adapted_logits):
    torch.testing.assert_close(_hf_logits(runs / "merged_hf"), adapted_logits, rtol=1e-5, atol=1e-5)


def test_peft_export_loads_with_peft_and_gives_the_adapted_logits(runs, adapted_logits):
    config = json.loads((runs / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    logits = _hf_logits(runs / "base_hf", runs / "peft")
    torch.testing.assert_close(logits, adapted_logits, rtol=1e-5, atol=1e-5)


def test_generate_with_the_adapters_follows_the_adapted_model(runs, adapted_logits):
    (record,) = [json.loads(line) for line in (runs / "generated.jsonl").read_text().splitlines()]
    args = Namespace(
        load=str(runs / "base"), ckpt_step=None, device="cpu", tokenizer_model=None,
        vocab_file=None, merge_file=None, lora_checkpoint=str(runs / "lora"),
    )  # fmt: skip
    (model,) = load_for_inference(args).chunks
    ids = [3, 17, 40, 41]
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.tensor([ids])
            logits = model(tokens, torch.arange(len(ids)).unsqueeze(0))[0, -1, :128]
            ids.append(int(logits.argmax()))
    assert record["tokens"] == ids[4:]
