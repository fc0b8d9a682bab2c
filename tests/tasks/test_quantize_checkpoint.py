"""`gigatron quantize` on a tiny GPT checkpoint: the written codes and scales, the fake-quantized
checkpoint's weights and WikiText perplexity equal to a hand dequantization, refusals that write
nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from task_helpers import SEQ, WIKITEXT, lambada_texts, save, tiny_model, window_perplexity

from gigatron.checkpoint.torch_format import CHECKPOINT_FILENAME, safe_load
from gigatron.cli import main as gigatron_main
from gigatron.quantize.calibration import calibration_samples, collect_hessians
from gigatron.quantize.checkpoint import read_packed
from gigatron.quantize.rtn import dequantize, unpack_int4
from gigatron.tasks.evaluate import evaluate
from helpers import write_jsonl

LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
RUNS = {"int8": ("int8-weight", 64, 8), "int4": ("int4-weight", 32, 4)}


def hand_dequantized(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Round-to-nearest by hand: per group, step = max |w| / (2^(bits-1) - 1)."""
    out = torch.empty_like(weight)
    top = 2 ** (bits - 1)
    for row in range(weight.shape[0]):
        for start in range(0, weight.shape[1], group):
            values = weight[row, start : start + group]
            step = values.abs().max() / (top - 1)
            codes = torch.round(values / step).clamp(-top, top - 1) if step > 0 else values * 0
            out[row, start : start + group] = codes * step
    return out


def hand_model(chunk, bits: int, group: int):
    model = copy.deepcopy(chunk)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.split(".")[-2] in LINEAR and name.endswith(".weight"):
                param.copy_(hand_dequantized(param, bits, group))
    return model.eval()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    directory = tmp_path_factory.mktemp("quantize")
    cfg, tokenizer, chunk = tiny_model()
    save(directory / "ckpt", cfg, chunk)
    for name, (method, group, _) in RUNS.items():
        argv = ["quantize", "--load", str(directory / "ckpt"), "--save", str(directory / name),
                "--method", method, "--group-size", str(group)]  # fmt: skip
        assert gigatron_main(argv) == 0
    wiki = directory / "wiki.test.tokens"
    wiki.write_text("".join(WIKITEXT.read_text(encoding="utf-8").splitlines(True)[:12]))
    return directory, tokenizer, chunk.eval(), wiki


def _saved_model(directory):
    (path,) = directory.glob(f"iter_*/mp_rank_*/{CHECKPOINT_FILENAME}")
    return safe_load(path)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_codes_scales_and_weights_equal_a_hand_dequantization(quantized, name):
    directory, _, chunk, _ = quantized
    method, group, bits = RUNS[name]
    state = _saved_model(directory / name)
    assert state["quantization"]["method"] == method
    assert len(state["quantization"]["layers"]) == 2 * len(LINEAR)
    packed, info = read_packed(directory / name)
    assert info["bits"] == bits and info["group_size"] == group
    original = chunk.state_dict()
    for layer in state["quantization"]["layers"]:
        weight = original[f"{layer}.weight"]
        stored = packed[f"{layer}.weight_packed"]
        codes = unpack_int4(stored, weight.shape[1]) if bits == 4 else stored
        if bits == 4:
            assert stored.numel() * 2 == weight.numel()  # two codes a byte
        back = dequantize(codes, packed[f"{layer}.weight_scale"], weight.dtype)
        assert torch.equal(state["model"][f"{layer}.weight"], back)
        assert torch.allclose(back, hand_dequantized(weight, bits, group), rtol=0, atol=1e-7)
    kept = "decoder.layers.0.self_attention.linear_qkv.bias"
    assert torch.equal(state["model"][kept], original[kept])
    assert torch.equal(state["model"]["embedding.word_embeddings.weight"],
                       original["embedding.word_embeddings.weight"])  # fmt: skip


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fake_quantized_perplexity_equals_the_hand_dequantized_models(quantized, name):
    directory, tokenizer, chunk, wiki = quantized
    _, group, bits = RUNS[name]
    text = wiki.read_text(encoding="utf-8")
    result = evaluate(["--load", str(directory / name), "--device", "cpu", "--task",
                       "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", str(SEQ),
                       "--no-progress-bar"])  # fmt: skip
    expected = window_perplexity(hand_model(chunk, bits, group), tokenizer, text)
    assert result["ppl"] == pytest.approx(expected, rel=1e-4)
    # The quantization changed the model: the original's perplexity differs.
    assert window_perplexity(chunk, tokenizer, text) != pytest.approx(expected, rel=1e-6)


def test_bad_inputs_are_refused_and_write_nothing(quantized, capsys):
    directory = quantized[0]
    base = ["quantize", "--load", str(directory / "ckpt"), "--method", "int4-weight"]
    target = directory / "refused"
    assert gigatron_main([*base, "--save", str(target), "--group-size", "48"]) == 2
    assert "decoder.layers.0.self_attention.linear_qkv: 64 input features are not divisible " \
        "by --group-size 48" in capsys.readouterr().err  # fmt: skip
    assert not target.exists()
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []
    assert gigatron_main([*base, "--save", str(directory / "int8")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


# ---- GPTQ calibration ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibrated(quantized):
    directory = quantized[0]
    data = write_jsonl(directory / "calib.jsonl", [{"text": t} for t in lambada_texts(30)])
    runs = {"a": 7, "b": 7, "c": 8}  # name -> seed
    for name, seed in runs.items():
        argv = ["quantize", "--load", str(directory / "ckpt"), "--save", str(directory / name),
                "--method", "int4-weight", "--group-size", "32", "--calib-data", str(data),
                "--calib-size", "6", "--seed", str(seed)]  # fmt: skip
        assert gigatron_main(argv) == 0
    return directory, data


def test_gptq_is_reproducible_and_lowers_the_layer_output_error(quantized, calibrated):
    _, tokenizer, chunk, _ = quantized
    directory, data = calibrated
    first, info = read_packed(directory / "a")
    again, _ = read_packed(directory / "b")
    other, _ = read_packed(directory / "c")
    assert info["algorithm"] == "gptq" and info["seed"] == 7 and info["size"] == 6
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)  # bit for bit under one seed
    assert any(not torch.equal(first[k], other[k]) for k in first)  # other windows, other codes
    state = _saved_model(directory / "a")["model"]
    rtn = _saved_model(directory / "int4")["model"]
    hessians = collect_hessians(chunk, calibration_samples(str(data), tokenizer, SEQ, 6, 7))
    original = chunk.state_dict()
    for layer, hessian in hessians.items():
        weight = original[f"{layer}.weight"].double()
        codes = unpack_int4(first[f"{layer}.weight_packed"], weight.shape[1])
        ours = dequantize(codes, first[f"{layer}.weight_scale"], torch.float32)
        assert torch.equal(state[f"{layer}.weight"], ours)
        # tr(E H E^T): the squared error of the layer's outputs on the calibration inputs.
        errors = [((weight - w.double()) @ hessian * (weight - w.double())).sum().item()
                  for w in (ours, rtn[f"{layer}.weight"])]  # fmt: skip
        assert errors[0] < errors[1], layer


def test_too_little_calibration_data_is_refused_and_writes_nothing(calibrated, capsys):
    directory, data = calibrated
    target = directory / "short"
    argv = ["quantize", "--load", str(directory / "ckpt"), "--save", str(target), "--method",
            "int8-weight", "--group-size", "32", "--calib-data", str(data), "--calib-size", "500"]  # fmt: skip
    assert gigatron_main(argv) == 2
    assert "--calib-size 500 needs 48000" in capsys.readouterr().err
    assert not target.exists()
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []
