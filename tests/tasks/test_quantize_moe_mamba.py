"""`gigatron quantize` beyond dense GPT layers: grouped MoE expert weights ([experts, out, in],
round-to-nearest or GPTQ per expert, each on the tokens routed to it) and a hybrid Mamba model's mixer in_proj / out_proj (GPTQ on
calibration data); the fake-quantized checkpoints hold the codes' dequantization, and the
combinations a method cannot take are refused naming the layer."""

from __future__ import annotations

import pytest
import torch
from task_helpers import model_flags

from gigatron.checkpoint.torch_format import CHECKPOINT_FILENAME, safe_load, save_checkpoint
from gigatron.cli import main as gigatron_main
from gigatron.config import parse_config
from gigatron.data.indexed import write_dataset
from gigatron.inference.load import _quantize_activations
from gigatron.models import build_model
from gigatron.models.activation_quant import fake_quantize_fp8
from gigatron.models.hybrid import build_model as build_hybrid
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.awq import layer_error
from gigatron.quantize.calibration import calibration_samples, collect_hessians, gptq_layer
from gigatron.quantize.checkpoint import read_packed
from gigatron.quantize.methods import METHODS
from gigatron.quantize.rtn import dequantize, quantize_weight, unpack_int4
from gigatron.training.pretrain import parse_pretrain_config

VOCAB, WINDOW = 96, 32
HYBRID = [
    "--hybrid-layer-pattern", "M*M-", "--hidden-size", "64", "--num-attention-heads", "4",
    "--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--seq-length", str(WINDOW), "--max-position-embeddings", str(WINDOW), "--vocab-size",
    str(VOCAB), "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--seed", "3",
]  # fmt: skip


def _saved(directory):
    (path,) = directory.glob(f"iter_*/mp_rank_*/{CHECKPOINT_FILENAME}")
    return safe_load(path)


def _save(directory, cfg, chunk, family):
    save_checkpoint(directory, 1, [chunk], None, None, ParallelContext.single(), cfg,
                    extra={"gigatron_family": family})  # fmt: skip


def test_grouped_expert_weights_round_to_nearest_per_expert(tmp_path, capsys):
    cfg = parse_pretrain_config(
        model_flags() + ["--num-experts", "4", "--moe-ffn-hidden-size", "64"], world_size=1
    )
    (chunk,) = build_model(cfg, ParallelContext.single(), vocab_size=50257)
    _save(tmp_path / "ckpt", cfg, chunk, "gpt")
    base = ["quantize", "--load", str(tmp_path / "ckpt"), "--method", "int4-weight",
            "--group-size", "32"]  # fmt: skip
    assert gigatron_main([*base, "--save", str(tmp_path / "int4")]) == 0
    packed, info = read_packed(tmp_path / "int4")
    state, original = _saved(tmp_path / "int4")["model"], chunk.state_dict()
    layer = "decoder.layers.1.mlp.experts.linear_fc2"
    assert layer in info["layers"]
    weight = original[f"{layer}.weight"]
    codes = unpack_int4(packed[f"{layer}.weight_packed"], 64)
    assert codes.shape == (4, 64, 64) and packed[f"{layer}.weight_scale"].shape == (4, 64, 2)
    for expert in range(4):  # each expert as a 2-D weight of its own
        alone = quantize_weight(weight[expert], METHODS["int4-weight"], 32)
        assert torch.equal(codes[expert], alone[0])
    back = dequantize(codes, packed[f"{layer}.weight_scale"], weight.dtype)
    assert torch.equal(state[f"{layer}.weight"], back)
    assert torch.equal(state["decoder.layers.1.mlp.router.weight"],
                       original["decoder.layers.1.mlp.router.weight"])  # fmt: skip
    data = tmp_path / "calib"
    write_dataset(data, [[list(range(50, 50 + 200))]])
    argv = [*base, "--save", str(tmp_path / "awq"), "--calib-data", str(data), "--calib-size", "2"]
    argv[argv.index("int4-weight")] = "int4-awq"
    assert gigatron_main(argv) == 2
    assert "decoder.layers.0.mlp.experts.linear_fc1: a weight of shape (4, 64, 64); --method " \
        "int4-awq quantizes 2-D" in capsys.readouterr().err  # fmt: skip
    assert not (tmp_path / "awq").exists()


def _routed_hessians(chunk, samples):
    """By hand: each expert's fc1 and fc2 input Hessians 2 X^T X / n over the samples (X: the
    tokens routed to it, and its activation of them)."""
    inputs = _routed_inputs(chunk, samples)
    return {key: 2 * x.T @ x / len(x) for key, x in inputs.items()}


def _routed_inputs(chunk, samples):
    """By hand: each (expert layer, expert)'s inputs over the samples, float64."""
    inputs = {}

    def keep(name, experts):
        def hook(_module, args):
            w1 = experts.linear_fc1.weight
            for e, x in enumerate(args[0].split(args[1].tolist())):
                fc2_input = experts.activation(x @ w1[e].T)
                for layer, rows in (("linear_fc1", x), ("linear_fc2", fc2_input)):
                    inputs.setdefault((f"{name}.{layer}", e), []).append(rows.double())

        return hook

    handles = [
        module.register_forward_pre_hook(keep(name, module))
        for name, module in chunk.named_modules()
        if name.endswith("mlp.experts")
    ]
    with torch.no_grad():
        for row in samples:
            chunk(row[None, :], None)
    for handle in handles:
        handle.remove()
    return {key: torch.cat(x) for key, x in inputs.items()}


def _moe_checkpoint(tmp_path, *flags: str):
    """(cfg, model, calibration data prefix): a 4-expert GPT saved as tmp_path/ckpt, and 400
    random tokens."""
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", *flags]
    cfg = parse_pretrain_config(model_flags() + moe, world_size=1)
    (chunk,) = build_model(cfg, ParallelContext.single(), vocab_size=50257)
    _save(tmp_path / "ckpt", cfg, chunk.eval(), "gpt")
    generator = torch.Generator().manual_seed(0)
    data = tmp_path / "calib"
    write_dataset(data, [[torch.randint(0, 50257, (400,), generator=generator).tolist()]])
    return cfg, chunk, data


def test_grouped_experts_take_gptq_per_expert_on_their_routed_tokens(tmp_path):
    cfg, chunk, data = _moe_checkpoint(tmp_path)
    argv = ["quantize", "--load", str(tmp_path / "ckpt"), "--method", "int4-weight",
            "--group-size", "32", "--calib-data", str(data), "--calib-size", "3"]  # fmt: skip
    assert gigatron_main([*argv, "--save", str(tmp_path / "gptq")]) == 0
    assert gigatron_main([*argv, "--save", str(tmp_path / "again")]) == 0
    packed, info = read_packed(tmp_path / "gptq")
    assert info["algorithm"] == "gptq"
    assert all(torch.equal(t, read_packed(tmp_path / "again")[0][k]) for k, t in packed.items())
    state, original = _saved(tmp_path / "gptq")["model"], chunk.state_dict()
    samples = calibration_samples(str(data), None, cfg.model.seq_length, 3, 1234)
    hessians = _routed_hessians(chunk, samples)
    assert len(hessians) == 2 * 2 * 4  # every expert of both layers got tokens
    collected = collect_hessians(chunk, samples)
    for (layer, expert), hessian in hessians.items():
        assert torch.allclose(collected[layer][expert], hessian, rtol=1e-9, atol=1e-12)
    for (layer, expert), hessian in hessians.items():
        weight = original[f"{layer}.weight"][expert]
        codes = unpack_int4(packed[f"{layer}.weight_packed"][expert], 64)
        ours = dequantize(codes, packed[f"{layer}.weight_scale"][expert], torch.float32)
        assert torch.equal(state[f"{layer}.weight"][expert], ours)
        rtn = dequantize(*quantize_weight(weight, METHODS["int4-weight"], 32), torch.float32)
        errors = [layer_error(weight, w, hessian) for w in (ours, rtn)]
        assert errors[0] < 0.9 * errors[1], (layer, expert)  # its own routed inputs' error


def test_an_expert_no_calibration_token_reached_is_rounded_to_nearest():
    torch.manual_seed(0)
    weight, x = torch.randn(3, 8, 32), torch.randn(20, 32, dtype=torch.float64)
    hessians = torch.stack(
        [2 * x.T @ x / 20, torch.zeros(32, 32, dtype=torch.float64), 2 * x.T @ x / 20]
    )
    method = METHODS["int4-weight"]
    codes, scales = gptq_layer(weight, hessians, method, 16)
    assert codes.shape == (3, 8, 32) and scales.shape == (3, 8, 2)
    rtn = quantize_weight(weight[1], method, 16)
    assert torch.equal(codes[1], rtn[0]) and torch.equal(scales[1], rtn[1])
    assert torch.equal(codes[0], gptq_layer(weight[0], hessians[0], method, 16)[0])
    assert not torch.equal(codes[0], quantize_weight(weight[0], method, 16)[0])


def test_mamba_mixer_projections_take_gptq_and_refuse_awq(tmp_path, capsys):
    cfg = parse_config(HYBRID)
    (chunk,) = build_hybrid(cfg, ParallelContext.single(), vocab_size=VOCAB)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in chunk.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    _save(tmp_path / "ckpt", cfg, chunk.eval(), "mamba")
    generator = torch.Generator().manual_seed(0)
    write_dataset(
        tmp_path / "calib", [[torch.randint(0, VOCAB, (300,), generator=generator).tolist()]]
    )
    base = ["quantize", "--load", str(tmp_path / "ckpt"), "--group-size", "32", "--calib-data",
            str(tmp_path / "calib"), "--calib-size", "4"]  # fmt: skip
    assert gigatron_main([*base, "--method", "int4-weight", "--save", str(tmp_path / "gptq")]) == 0
    packed, info = read_packed(tmp_path / "gptq")
    state, original = _saved(tmp_path / "gptq")["model"], chunk.state_dict()
    mixers = [layer for layer in info["layers"] if ".mixer." in layer]
    assert mixers == [
        f"decoder.layers.{i}.mixer.{p}" for i in (0, 2) for p in ("in_proj", "out_proj")
    ]
    hessians = collect_hessians(
        chunk, calibration_samples(str(tmp_path / "calib"), None, WINDOW, 4, 1234)
    )
    for layer in mixers:
        weight = original[f"{layer}.weight"]
        codes = unpack_int4(packed[f"{layer}.weight_packed"], weight.shape[1])
        ours = dequantize(codes, packed[f"{layer}.weight_scale"], torch.float32)
        assert torch.equal(state[f"{layer}.weight"], ours)
        rtn = dequantize(*quantize_weight(weight, METHODS["int4-weight"], 32), torch.float32)
        errors = [layer_error(weight, w, hessians[layer]) for w in (ours, rtn)]
        assert errors[0] < errors[1], layer  # GPTQ lowers the mixer's output error
    conv = "decoder.layers.0.mixer.conv1d.weight"
    assert torch.equal(state[conv], original[conv])  # not a linear layer: kept
    assert gigatron_main([*base, "--method", "int4-awq", "--save", str(tmp_path / "awq")]) == 2
    assert "decoder.layers.0.mixer.in_proj: a Mamba mixer projection; --method int4-awq" in (
        capsys.readouterr().err
    )  # fmt: skip
    assert not (tmp_path / "awq").exists()


def _experts_by_hand(scales):
    """A forward hook giving grouped experts' output by hand: per expert block, fc1's input and
    fc2's input rounded to e4m3 with that expert's static scale."""

    def hook(module, args, _output):
        w1, w2 = module.linear_fc1.weight, module.linear_fc2.weight
        fc1, fc2 = scales(module)
        outputs = []
        for e, x in enumerate(args[0].split(args[1].tolist())):
            h = module.activation(fake_quantize_fp8(x, fc1[e]) @ w1[e].T)
            outputs.append(fake_quantize_fp8(h, fc2[e]) @ w2[e].T)
        return torch.cat(outputs)

    return hook


def test_grouped_experts_in_fp8_with_a_static_input_scale_per_expert(tmp_path):
    cfg, chunk, data = _moe_checkpoint(tmp_path, "--disable-bias-linear")
    argv = ["quantize", "--load", str(tmp_path / "ckpt"), "--method", "fp8-tensor",
            "--calib-data", str(data), "--calib-size", "3", "--save", str(tmp_path / "fp8")]  # fmt: skip
    assert gigatron_main(argv) == 0
    packed, info = read_packed(tmp_path / "fp8")
    original = chunk.state_dict()
    samples = calibration_samples(str(data), None, cfg.model.seq_length, 3, 1234)
    inputs = _routed_inputs(chunk, samples)
    for layer in (
        "decoder.layers.1.mlp.experts.linear_fc1",
        "decoder.layers.0.mlp.experts.linear_fc2",
    ):
        weight = original[f"{layer}.weight"]
        assert torch.equal(packed[f"{layer}.weight_scale"], weight.abs().amax((1, 2), True) / 448)
        by_hand = [inputs[(layer, e)].abs().max().item() / 448 for e in range(4)]
        assert info["input_scales"][layer] == pytest.approx(by_hand, rel=1e-6)
        assert len(set(by_hand)) > 1  # each expert its own (top-2: a token reaches two)
    loaded = build_model(cfg, ParallelContext.single(), vocab_size=50257)[0].eval()
    loaded.load_state_dict(_saved(tmp_path / "fp8")["model"])
    hand = build_model(cfg, ParallelContext.single(), vocab_size=50257)[0].eval()
    hand.load_state_dict(loaded.state_dict())
    _quantize_activations([loaded], tmp_path / "fp8", None, 1)  # what evaluate/generate do
    scales = info["input_scales"]
    for name, module in hand.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_hook(_experts_by_hand(
                lambda m, n=name: (scales[f"{n}.linear_fc1"], scales[f"{n}.linear_fc2"])
            ))  # fmt: skip
    for layer in info["layers"]:
        if "experts" not in layer:
            hand.get_submodule(layer).register_forward_pre_hook(
                lambda _, x, s=scales[layer]: (fake_quantize_fp8(x[0], s),)
            )
    tokens = samples[:2]
    with torch.no_grad():
        ours = loaded(tokens, None)
        weights_only = build_model(cfg, ParallelContext.single(), vocab_size=50257)[0].eval()
        weights_only.load_state_dict(loaded.state_dict())
        torch.testing.assert_close(ours, hand(tokens, None), rtol=1e-5, atol=1e-5)
        assert (ours - weights_only(tokens, None)).abs().max() > 1e-3
