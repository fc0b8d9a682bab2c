"""`gigatron quantize --hf-save`: a Hugging Face folder in the compressed-tensors format from a
tiny random Llama (nothing downloaded): its quantization config and stored integer codes, and
transformers' logits on CPU equal to gigatron's fake-quantized checkpoint's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open

from gigatron.checkpoint.hf_convert import hf_to_gigatron
from gigatron.checkpoint.safetensors_io import INDEX_FILE
from gigatron.checkpoint.torch_format import safe_load
from gigatron.cli import main as gigatron_main
from gigatron.config import config_from_dict
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.checkpoint import read_packed
from gigatron.quantize.rtn import unpack_int4
from hf_helpers import llama_gqa_config, randomise

VOCAB, SEQ = 100, 16
RUNS = {"int8": ("int8-weight", 32, 8), "int4": ("int4-weight", 16, 4)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("quantize-export")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(llama_gqa_config(VOCAB))
    randomise(hf, 0.1)
    hf.eval().save_pretrained(directory / "hf")
    hf_to_gigatron(directory / "hf", directory / "ckpt", log=lambda _: None)
    for name, (method, group, _) in RUNS.items():
        argv = ["quantize", "--load", str(directory / "ckpt"), "--save", str(directory / name),
                "--method", method, "--group-size", str(group),
                "--hf-save", str(directory / f"{name}-hf"), "--max-shard-size", "40KB"]  # fmt: skip
        assert gigatron_main(argv) == 0
    return directory


def _gigatron_logits(checkpoint, tokens):
    state = safe_load(checkpoint / "release" / "mp_rank_00" / "model_optim_rng.pt")
    cfg = config_from_dict(state["args"])
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.load_state_dict(state["model"], strict=True)
    with torch.no_grad():
        return model.eval()(tokens, torch.arange(SEQ).expand_as(tokens))[..., :VOCAB]


def _stored(folder, name):
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    with safe_open(str(folder / index[name]), framework="pt") as handle:
        return handle.get_tensor(name)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_transformers_loads_the_export_with_gigatrons_fake_quantized_logits(exported, name):
    _, group, bits = RUNS[name]
    folder = exported / f"{name}-hf"
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (
        bits, group, True
    )  # fmt: skip
    assert config["ignore"] == ["lm_head"]
    assert len(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values())) > 1

    # The stored codes are gigatron's (o_proj is linear_proj, unsplit), 32 / bits an int32.
    codes, _ = read_packed(exported / name)
    ours = codes["decoder.layers.1.self_attention.linear_proj.weight_packed"]
    ours = unpack_int4(ours, 64) if bits == 4 else ours
    packed = _stored(folder, "model.layers.1.self_attn.o_proj.weight_packed")
    assert packed.dtype == torch.int32 and packed.numel() * 32 // bits == 64 * 64
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size((64, 64))).to(torch.int8), ours)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = model(tokens).logits
    fake = _gigatron_logits(exported / name, tokens)
    assert (theirs - fake).abs().max().item() < 1e-3
    # The quantization shows: the unquantized model's logits differ.
    assert (fake - _gigatron_logits(exported / "ckpt", tokens)).abs().max().item() > 1e-3


def test_an_existing_hf_folder_is_refused_before_quantizing(exported, capsys):
    argv = ["quantize", "--load", str(exported / "ckpt"), "--save", str(exported / "again"),
            "--method", "int8-weight", "--group-size", "32",
            "--hf-save", str(exported / "int8-hf")]  # fmt: skip
    assert gigatron_main(argv) == 2
    assert "--hf-save" in capsys.readouterr().err
    assert not (exported / "again").exists()
