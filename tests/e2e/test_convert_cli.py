"""`gigatron convert` as a command: a Hugging Face Llama folder with tokenizer files to a
tensor-parallel gigatron checkpoint and back, bit-exact, tokenizer files copied both ways."""

from __future__ import annotations

import subprocess

import torch
import transformers
from safetensors.torch import load_file

from helpers import gigatron


def _gigatron(*args: str) -> subprocess.CompletedProcess:
    return gigatron(*args, check=False)


def test_convert_command_round_trip(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"model": "test"}')

    done = _gigatron(
        "convert", "--from", "hf", "--to", "gigatron", "--load", str(tmp_path / "hf"),
        "--save", str(tmp_path / "ckpt"), "--target-tensor-parallel-size", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "family gpt" in done.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt" / "release").iterdir()) == [
        "mp_rank_00",
        "mp_rank_01",
    ]
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == '{"model": "test"}'

    done = _gigatron(
        "convert", "--from", "gigatron", "--to", "hf", "--load", str(tmp_path / "ckpt"),
        "--save", str(tmp_path / "back"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert (tmp_path / "back" / "tokenizer.json").is_file()

    done = _gigatron(
        "convert", "--from", "hf", "--to", "gigatron", "--load", str(tmp_path / "nowhere"),
        "--save", str(tmp_path / "x"),
    )  # fmt: skip
    assert done.returncode == 2 and "no such directory" in done.stderr
