"""`gigatron evaluate` on W8A8 checkpoints of a tiny GPT (LayerNorm with biases, GELU): the loader
fake-quantizes every quantized layer's inputs (per-token int8 for `int8-smoothquant`; fp8 with
static scales, and keys and values with `--kv-cache-dtype fp8`), so the perplexity is the hand
model's (the checkpoint's weights, inputs quantized by hand), not the weights-only one."""

from __future__ import annotations

import pytest
import torch
from task_helpers import SEQ, WIKITEXT, lambada_texts, save, tiny_model, window_perplexity

from gigatron.checkpoint.torch_format import CHECKPOINT_FILENAME, safe_load
from gigatron.cli import main as gigatron_main
from gigatron.models import build_model
from gigatron.models.activation_quant import (
    fake_quantize_fp8,
    fake_quantize_tokens,
    quantize_linear_inputs,
)
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.calibration import calibration_samples
from gigatron.tasks.evaluate import evaluate
from helpers import write_jsonl


def test_evaluate_runs_a_w8a8_checkpoint_with_int8_inputs(tmp_path):
    cfg, tokenizer, chunk = tiny_model()
    save(tmp_path / "ckpt", cfg, chunk)
    data = write_jsonl(tmp_path / "calib.jsonl", [{"text": t} for t in lambada_texts(30)])
    argv = ["quantize", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "w8a8"),
            "--method", "int8-smoothquant", "--calib-data", str(data), "--calib-size", "4"]  # fmt: skip
    assert gigatron_main(argv) == 0
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text("".join(WIKITEXT.read_text(encoding="utf-8").splitlines(True)[:12]))
    result = evaluate(["--load", str(tmp_path / "w8a8"), "--device", "cpu", "--task",
                       "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", str(SEQ),
                       "--no-progress-bar"])  # fmt: skip
    (path,) = (tmp_path / "w8a8").glob(f"iter_*/mp_rank_*/{CHECKPOINT_FILENAME}")
    state = safe_load(path)
    chunk.load_state_dict(state["model"])
    text = wiki.read_text(encoding="utf-8")
    weights_only = window_perplexity(chunk.eval(), tokenizer, text)
    modules = dict(chunk.named_modules())
    for layer in state["quantization"]["layers"]:  # by hand: each input row to int8 codes
        modules[layer].register_forward_pre_hook(lambda _, x: (fake_quantize_tokens(x[0], 8),))
    assert result["ppl"] == pytest.approx(window_perplexity(chunk, tokenizer, text), rel=1e-5)
    assert result["ppl"] != pytest.approx(weights_only, rel=1e-5)


def test_fp8_kv_cache_scales_from_calibration_and_evaluate(tmp_path):
    cfg, tokenizer, chunk = tiny_model()
    save(tmp_path / "ckpt", cfg, chunk)
    data = write_jsonl(tmp_path / "calib.jsonl", [{"text": t} for t in lambada_texts(30)])
    argv = ["quantize", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "fp8"),
            "--method", "fp8-tensor", "--calib-data", str(data), "--calib-size", "4",
            "--kv-cache-dtype", "fp8"]  # fmt: skip
    assert gigatron_main(argv) == 0
    # By hand: the largest |key| and |value| each attention sees on the calibration windows.
    largest = {}
    modules = dict(chunk.eval().named_modules())
    for name, module in modules.items():
        if name.endswith("core_attention"):
            module.register_forward_pre_hook(
                lambda _, x, n=name: largest.setdefault(n, []).append(
                    (x[1].abs().max().item(), x[2].abs().max().item())
                )
            )
    with torch.no_grad():
        for row in calibration_samples(str(data), tokenizer, SEQ, 4, 1234):
            chunk(row[None, :], None)
    (path,) = (tmp_path / "fp8").glob(f"iter_*/mp_rank_*/{CHECKPOINT_FILENAME}")
    state = safe_load(path)
    scales = state["quantization"]["kv_cache_scales"]
    assert sorted(scales) == sorted(largest)
    for name, seen in largest.items():
        hand = [max(s[0] for s in seen) / 448, max(s[1] for s in seen) / 448]
        assert scales[name] == pytest.approx(hand, rel=1e-6)
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text("".join(WIKITEXT.read_text(encoding="utf-8").splitlines(True)[:12]))
    result = evaluate(["--load", str(tmp_path / "fp8"), "--device", "cpu", "--task",
                       "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", str(SEQ),
                       "--no-progress-bar"])  # fmt: skip
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=tokenizer.vocab_size)
    model.load_state_dict(state["model"])
    info = state["quantization"]
    quantize_linear_inputs([model], info["layers"], 8, 1, static_scales=info["input_scales"])
    text = wiki.read_text(encoding="utf-8")
    without_kv = window_perplexity(model.eval(), tokenizer, text)
    for name, (key, value) in scales.items():  # e4m3 keys and values by hand
        dict(model.named_modules())[name].register_forward_pre_hook(
            lambda _, x, k=key, v=value: (
                x[0],
                fake_quantize_fp8(x[1], k),
                fake_quantize_fp8(x[2], v),
                *x[3:],
            )  # fmt: skip
        )
    assert result["ppl"] == pytest.approx(window_perplexity(model, tokenizer, text), rel=1e-5)
    assert result["ppl"] != pytest.approx(without_kv, rel=1e-6)
