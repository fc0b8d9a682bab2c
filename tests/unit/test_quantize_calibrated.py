"""`gigatron quantize --method int4-awq|int8-smoothquant` on a tiny random Llama (SwiGLU, RMSNorm,
a few outlier input channels) calibrated on a .bin/.idx dataset: the codes reproducible bit for
bit, each weight's error within half a (scaled) step; AWQ: each layer's output error on the
calibration inputs at most round-to-nearest's, the folded model's logits equal to the unfolded
hand model's; SmoothQuant: hand-computed smoothing scales, per-token int8 inputs; the
compressed-tensors exports' logits in transformers equal to gigatron's fake-quantized ones."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gigatron.checkpoint.hf_convert import hf_to_gigatron
from gigatron.checkpoint.torch_format import safe_load
from gigatron.cli import main as gigatron_main
from gigatron.config import config_from_dict
from gigatron.data.indexed import write_dataset
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.activation_quant import (
    fake_quantize_fp8,
    fake_quantize_tokens,
    quantize_kv_cache,
    quantize_linear_inputs,
)
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.awq import layer_error
from gigatron.quantize.calibration import (
    calibration_samples,
    collect_hessians,
    collect_statistics,
)
from gigatron.quantize.checkpoint import read_packed
from gigatron.quantize.export import kv_cache_scales
from gigatron.quantize.folding import check_foldable
from gigatron.quantize.methods import METHODS
from gigatron.quantize.rtn import dequantize, quantize_weight, unpack_int4
from gigatron.quantize.trtllm import export_trtllm
from hf_helpers import llama_gqa_config, randomise

VOCAB, SEQ, GROUP, SIZE = 100, 16, 16, 8
WINDOW = 64  # calibration window: the converted checkpoint's --seq-length (its context)
OUTLIERS = [3, 17, 40]
FP8 = ("fp8-channel", "fp8-tensor")  # input channels the norms make large: AWQ protects them


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("awq")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(llama_gqa_config(VOCAB))
    randomise(hf, 0.1)
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[OUTLIERS] = 8.0
    hf.eval().save_pretrained(directory / "hf")
    hf_to_gigatron(directory / "hf", directory / "ckpt", log=lambda _: None)
    generator = torch.Generator().manual_seed(0)
    documents = [[torch.randint(0, VOCAB, (200,), generator=generator).tolist()] for _ in range(4)]
    write_dataset(directory / "calib", documents)
    base = ["quantize", "--load", str(directory / "ckpt"), "--method", "int4-awq",
            "--group-size", str(GROUP), "--calib-data", str(directory / "calib"),
            "--calib-size", str(SIZE)]  # fmt: skip
    assert gigatron_main([*base, "--save", str(directory / "a"),
                          "--hf-save", str(directory / "a-hf")]) == 0  # fmt: skip
    assert gigatron_main([*base, "--save", str(directory / "b")]) == 0
    smooth = [*base[:3], "--method", "int8-smoothquant", *base[7:]]
    assert gigatron_main([*smooth, "--save", str(directory / "sq"),
                          "--hf-save", str(directory / "sq-hf")]) == 0  # fmt: skip
    assert gigatron_main([*smooth, "--save", str(directory / "sq2")]) == 0
    for name in FP8:
        argv = [*base[:3], "--method", name, *base[7:], "--save", str(directory / name),
                "--hf-save", str(directory / f"{name}-hf")]  # fmt: skip
        assert gigatron_main(argv) == 0
    kv = [*base[:3], "--method", "fp8-tensor", *base[7:], "--kv-cache-dtype", "fp8"]
    assert gigatron_main([*kv, "--save", str(directory / "fp8-kv"),
                          "--hf-save", str(directory / "fp8-kv-hf")]) == 0  # fmt: skip
    return directory


def _model(checkpoint, activations: bool = False):
    state = safe_load(next(checkpoint.glob("*/mp_rank_00/model_optim_rng.pt")))
    cfg = config_from_dict(state["args"])
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.load_state_dict(state["model"], strict=True)
    if activations:  # as `generate`/`evaluate` load a W8A8 checkpoint (inference/load.py)
        info = state["quantization"]
        quantize_linear_inputs([model], info["layers"], info["activation_bits"], 1,
                               static_scales=info.get("input_scales"))  # fmt: skip
    return model.eval(), state


def _effective(packed, layer, weight, key="awq_scale"):
    """The weight the folded model computes with: Q(W s) / s, fc1's up rows times fc2's s."""
    codes = packed[f"{layer}.weight_packed"]
    codes = codes if key == "smooth_scale" else unpack_int4(codes, weight.shape[1])
    effective = dequantize(codes, packed[f"{layer}.weight_scale"], torch.float32)
    scale = packed.get(f"{layer}.{key}", torch.ones(weight.shape[1]))
    effective = effective / scale
    after = packed.get(f"{layer.removesuffix('fc1')}fc2.{key}")
    if layer.endswith("linear_fc1") and after is not None:
        effective[after.numel() :] *= after[:, None]
    return effective, scale


def test_awq_codes_are_reproducible_and_its_layer_errors_at_most_rtns(runs):
    first, info = read_packed(runs / "a")
    again, _ = read_packed(runs / "b")
    assert info["algorithm"] == "awq" and info["size"] == SIZE
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)  # bit for bit
    scaled = {k.removesuffix(".awq_scale") for k in first if k.endswith(".awq_scale")}
    assert scaled == {f"decoder.layers.{i}.{n}" for i in (0, 1)
                      for n in ("self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")}  # fmt: skip
    model, state = _model(runs / "ckpt")
    samples = calibration_samples(str(runs / "calib"), None, WINDOW, SIZE, 1234)
    hessians = collect_hessians(model, samples)
    original = model.state_dict()
    for layer in info["layers"]:
        weight = original[f"{layer}.weight"]
        effective, scale = _effective(first, layer, weight)
        if not layer.endswith("linear_fc1"):  # fc1's up rows also carry fc2's 1/s
            step = first[f"{layer}.weight_scale"].repeat_interleave(GROUP, 1) / scale
            assert ((weight - effective).abs() <= step / 2 + 1e-6).all(), layer
        rtn = dequantize(*quantize_weight(weight, METHODS["int4-weight"], GROUP), torch.float32)
        errors = [layer_error(weight, w, hessians[layer]) for w in (effective, rtn)]
        if layer in scaled and not layer.endswith("linear_fc1"):
            assert errors[0] < 0.9 * errors[1], layer  # the outlier channels are protected
        elif layer not in scaled:
            assert errors[0] == errors[1], layer  # s = 1: round-to-nearest


def test_folded_checkpoint_computes_the_hand_model_and_transformers_the_same(runs):
    packed, _ = read_packed(runs / "a")
    fake, state = _model(runs / "a")
    hand, _ = _model(runs / "ckpt")
    weights = hand.state_dict()
    for layer in state["quantization"]["layers"]:
        weights[f"{layer}.weight"] = _effective(packed, layer, weights[f"{layer}.weight"])[0]
    hand.load_state_dict(weights)
    norm = "decoder.layers.0.input_layernorm.weight"
    scale = packed["decoder.layers.0.self_attention.linear_qkv.awq_scale"]
    assert torch.allclose(state["model"][norm] * scale, weights[norm], rtol=1e-6)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        ours = fake(tokens, positions)[..., :VOCAB]
        assert (hand(tokens, positions)[..., :VOCAB] - ours).abs().max() < 1e-4
        exported = transformers.AutoModelForCausalLM.from_pretrained(runs / "a-hf").eval()
        assert (exported(tokens).logits - ours).abs().max() < 1e-3
        original = _model(runs / "ckpt")[0](tokens, positions)[..., :VOCAB]
    assert (ours - original).abs().max() > 1e-2  # the quantization shows


def test_awq_without_calibration_data_or_on_unfoldable_norms_is_refused(runs, capsys):
    argv = ["quantize", "--load", str(runs / "ckpt"), "--save", str(runs / "refused"),
            "--method", "int4-awq", "--group-size", str(GROUP)]  # fmt: skip
    assert gigatron_main(argv) == 2
    assert "--method int4-awq: calibrates on text; give --calib-data" in capsys.readouterr().err
    assert not (runs / "refused").exists()
    cfg = SimpleNamespace(apply_residual_connection_post_layernorm=True)
    with pytest.raises(GigatronError, match="^--apply-residual-connection-post-layernorm: "):
        check_foldable(cfg)


def _weights_and_input_max(runs):
    """The unquantized model's weights and each layer's input max |x| over the calibration set."""
    model, _ = _model(runs / "ckpt")
    samples = calibration_samples(str(runs / "calib"), None, WINDOW, SIZE, 1234)
    _, _, input_max = collect_statistics(model, samples)
    return model.state_dict(), input_max


# ---- SmoothQuant (W8A8) ---------------------------------------------------------------------
def test_smoothquant_scales_codes_and_error_bound(runs):
    first, info = read_packed(runs / "sq")
    again, _ = read_packed(runs / "sq2")
    assert info["algorithm"] == "smoothquant" and info["activation_bits"] == 8
    assert info["group_size"] is None
    assert all(torch.equal(first[k], again[k]) for k in first) and first.keys() == again.keys()
    original, input_max = _weights_and_input_max(runs)
    for layer in info["layers"]:
        weight = original[f"{layer}.weight"]
        assert first[f"{layer}.weight_packed"].dtype == torch.int8
        assert first[f"{layer}.weight_scale"].shape == (weight.shape[0], 1)  # one per row
        if f"{layer}.smooth_scale" in first:  # s = sqrt(max |x_j| / max_i |W_ij|)
            hand = (input_max[layer] / weight.abs().amax(dim=0).double()).sqrt().float()
            assert torch.allclose(first[f"{layer}.smooth_scale"], hand, rtol=1e-5)
        effective, scale = _effective(first, layer, weight, "smooth_scale")
        if not layer.endswith("linear_fc1"):
            step = first[f"{layer}.weight_scale"] / scale
            assert ((weight - effective).abs() <= step / 2 + 1e-6).all(), layer
    assert "decoder.layers.0.self_attention.linear_proj.smooth_scale" not in first  # s = 1


def test_smoothquant_export_computes_gigatrons_per_token_int8_inputs(runs):
    config = json.loads((runs / "sq-hf" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized"
    group = config["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    inputs = group["input_activations"]
    assert (inputs["strategy"], inputs["dynamic"], inputs["num_bits"]) == ("token", True, 8)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        ours = _model(runs / "sq", activations=True)[0](tokens, positions)[..., :VOCAB]
        weights_only = _model(runs / "sq")[0](tokens, positions)[..., :VOCAB]
        exported = transformers.AutoModelForCausalLM.from_pretrained(runs / "sq-hf").eval()
        assert (exported(tokens).logits - ours).abs().max() < 1e-3
    assert (weights_only - ours).abs().max() > 1e-3  # the inputs are quantized too


def test_per_token_fake_quantization_by_hand():
    x = torch.tensor([[2.55, -1.0, 0.0], [0.0, 0.0, 0.0], [0.3, -0.11, 0.021]])
    out = fake_quantize_tokens(x, 8)
    step = 2.55 / 127.5  # max |x| / 127.5: the largest value rounds to 128, clamped to 127
    assert out[0].tolist() == pytest.approx([127 * step, -50 * step, 0.0])
    assert out[1].tolist() == [0.0, 0.0, 0.0]
    assert out[2].tolist() == pytest.approx([127 * 0.3 / 127.5, -47 * 0.3 / 127.5, 9 * 0.3 / 127.5])
    with pytest.raises(GigatronError, match="tensor-parallel 1"):
        quantize_linear_inputs([torch.nn.Linear(2, 2)], [""], 8, 2)


def test_smoothquant_refuses_a_group_size(runs, capsys):
    argv = ["quantize", "--load", str(runs / "ckpt"), "--save", str(runs / "refused"),
            "--method", "int8-smoothquant", "--group-size", "16"]  # fmt: skip
    assert gigatron_main(argv) == 2
    assert "--group-size 16: --method int8-smoothquant has one weight scale per output row" in (
        capsys.readouterr().err
    )  # fmt: skip
    assert not (runs / "refused").exists()


# ---- fp8 (e4m3 weights, static e4m3 inputs) -------------------------------------------------
@pytest.mark.parametrize("name", FP8)
def test_fp8_codes_scales_and_input_scales(runs, name):
    packed, info = read_packed(runs / name)
    assert info["number"] == "float" and info["algorithm"] == "fp8"
    original, input_max = _weights_and_input_max(runs)
    for layer in info["layers"]:
        weight = original[f"{layer}.weight"]
        codes, scales = packed[f"{layer}.weight_packed"], packed[f"{layer}.weight_scale"]
        assert codes.dtype == torch.float8_e4m3fn
        top = (
            weight.abs().amax(dim=1, keepdim=True) if name == "fp8-channel" else weight.abs().max()
        )
        assert torch.equal(scales, (top / 448).reshape(scales.shape))  # max |w| lands on 448
        assert scales.shape == ((weight.shape[0], 1) if name == "fp8-channel" else (1, 1))
        back = codes.float() * scales
        # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal steps 2^-9 x scale.
        bound = torch.maximum(weight.abs() * 2**-4, scales * 2**-10)
        assert ((weight - back).abs() <= bound * (1 + 1e-6)).all(), layer
        expected = (input_max[layer].max() / 448).float()
        assert packed[f"{layer}.input_scale"].item() == pytest.approx(expected.item(), rel=1e-6)
        assert info["input_scales"][layer] == packed[f"{layer}.input_scale"].item()


@pytest.mark.parametrize("name", FP8)
def test_fp8_export_loads_in_transformers_with_gigatrons_logits(runs, name):
    config = json.loads((runs / f"{name}-hf" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    group = config["config_groups"]["group_0"]
    assert (group["weights"]["type"], group["weights"]["strategy"]) == ("float", name[4:])
    inputs = group["input_activations"]
    assert (inputs["type"], inputs["strategy"], inputs["dynamic"]) == ("float", "tensor", False)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        ours = _model(runs / name, activations=True)[0](tokens, positions)[..., :VOCAB]
        weights_only = _model(runs / name)[0](tokens, positions)[..., :VOCAB]
        exported = transformers.AutoModelForCausalLM.from_pretrained(runs / f"{name}-hf").eval()
        assert (exported(tokens).logits - ours).abs().max() < 1e-3
    assert (weights_only - ours).abs().max() > 1e-3  # the inputs are quantized too


def _exported_tensors(folder):
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(_read_all(path))
    return tensors


def test_fp8_kv_cache_export_computes_gigatrons_logits(runs):
    """The exported k_scale/v_scale, used by hand in transformers' attention (keys after RoPE
    and values rounded to e4m3 before SDPA, as vLLM's fp8 cache stores them), give gigatron's
    logits; transformers' own loader does not apply compressed-tensors' kv_cache_scheme."""
    config = json.loads((runs / "fp8-kv-hf" / "config.json").read_text())["quantization_config"]
    scheme = config["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"], scheme["dynamic"]) == (
        8, "float", "tensor", False
    )  # fmt: skip
    _, info = read_packed(runs / "fp8-kv")
    tensors = _exported_tensors(runs / "fp8-kv-hf")
    scales = {}
    for i in (0, 1):
        key, value = info["kv_cache_scales"][f"decoder.layers.{i}.self_attention.core_attention"]
        k, v = (tensors[f"model.layers.{i}.self_attn.{n}_scale"] for n in "kv")
        assert k.shape == v.shape == (1,) and (k.item(), v.item()) == pytest.approx((key, value))
        scales[i] = (k.item(), v.item())

    def fp8_cache_attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        key, value = fake_quantize_fp8(key, k_scale), fake_quantize_fp8(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("test-fp8-kv-cache", fp8_cache_attention)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        model, state = _model(runs / "fp8-kv", activations=True)
        without_kv = model(tokens, positions)[..., :VOCAB]
        assert quantize_kv_cache([model], state["quantization"]["kv_cache_scales"]) == 2
        ours = model(tokens, positions)[..., :VOCAB]
        exported = transformers.AutoModelForCausalLM.from_pretrained(
            runs / "fp8-kv-hf", attn_implementation="test-fp8-kv-cache"
        ).eval()
        assert (exported(tokens).logits - ours).abs().max() < 1e-3
    assert (without_kv - ours).abs().max() > 1e-3  # the cache's rounding shows


# ---- TensorRT-LLM checkpoint ----------------------------------------------------------------
def _trtllm_qkv(fused: torch.Tensor) -> torch.Tensor:
    """Megatron's fused QKV rows (per key-value group: its 4 query heads, its key head, its value
    head; head size 8) as TensorRT-LLM's [all q; all k; all v]."""
    groups = fused.reshape(2, 6 * 8, *fused.shape[1:])
    q, k, v = groups[:, : 4 * 8], groups[:, 4 * 8 : 5 * 8], groups[:, 5 * 8 :]
    return torch.cat([part.reshape(-1, *fused.shape[1:]) for part in (q, k, v)])


def _read_all(path):
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_trtllm_fp8_checkpoint_names_shapes_and_codes_by_hand(runs, capsys):
    export_trtllm(runs / "fp8-tensor", runs / "trt-fp8", log=lambda _: None)
    config = json.loads((runs / "trt-fp8" / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "float32"
    assert config["quantization"]["quant_algo"] == "FP8"
    expected = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_size": 8,
                "intermediate_size": 96, "rotary_base": 500.0, "vocab_size": VOCAB}  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    ours = _read_all(runs / "trt-fp8" / "rank0.safetensors")
    assert config["quantization"]["kv_cache_quant_algo"] is None
    assert not [name for name in ours if name.endswith("kv_cache_scaling_factor")]
    packed, _ = read_packed(runs / "fp8-tensor")
    state = _model(runs / "fp8-tensor")[1]["model"]
    for i in (0, 1):
        theirs, g = f"transformer.layers.{i}", f"decoder.layers.{i}"
        codes = {n: packed[f"{g}.{n}.weight_packed"].float() for n in
                 ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                  "mlp.linear_fc2")}  # fmt: skip
        by_hand = {
            "attention.qkv": (_trtllm_qkv(codes["self_attention.linear_qkv"]), "self_attention.linear_qkv"),
            "attention.dense": (codes["self_attention.linear_proj"], "self_attention.linear_proj"),
            "mlp.fc": (codes["mlp.linear_fc1"][:96], "mlp.linear_fc1"),  # gate: the activated half
            "mlp.gate": (codes["mlp.linear_fc1"][96:], "mlp.linear_fc1"),  # up
            "mlp.proj": (codes["mlp.linear_fc2"], "mlp.linear_fc2"),
        }  # fmt: skip
        for name, (weight, layer) in by_hand.items():
            assert ours[f"{theirs}.{name}.weight"].dtype == torch.float8_e4m3fn
            assert torch.equal(ours[f"{theirs}.{name}.weight"].float(), weight), name
            assert torch.equal(ours[f"{theirs}.{name}.weights_scaling_factor"],
                               packed[f"{g}.{layer}.weight_scale"].reshape(1))  # fmt: skip
            assert torch.equal(ours[f"{theirs}.{name}.activation_scaling_factor"],
                               packed[f"{g}.{layer}.input_scale"])  # fmt: skip
        assert torch.equal(ours[f"{theirs}.post_layernorm.weight"],
                           state[f"{g}.pre_mlp_layernorm.weight"])  # fmt: skip
    assert torch.equal(ours["transformer.vocab_embedding.weight"],
                       state["embedding.word_embeddings.weight"][:VOCAB])  # fmt: skip
    assert torch.equal(ours["transformer.ln_f.weight"], state["decoder.final_layernorm.weight"])
    with pytest.raises(GigatronError, match="^--export-format trtllm: --method fp8-channel"):
        export_trtllm(runs / "fp8-channel", runs / "trt-refused")
    assert not (runs / "trt-refused").exists()


def test_kv_cache_scales_of_an_attention_the_exports_do_not_name_are_refused():
    info = {"kv_cache_scales": {"decoder.layers.0.mixer.attention": [0.1, 0.2]}}
    with pytest.raises(GigatronError, match=r"^decoder\.layers\.0\.mixer\.attention: fp8 KV"):
        kv_cache_scales(info)


def test_trtllm_fp8_kv_cache_takes_the_larger_scale_of_each_layer(runs):
    export_trtllm(runs / "fp8-kv", runs / "trt-fp8-kv", log=lambda _: None)
    config = json.loads((runs / "trt-fp8-kv" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == config["quantization"]["kv_cache_quant_algo"]
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"
    ours = _read_all(runs / "trt-fp8-kv" / "rank0.safetensors")
    scales = read_packed(runs / "fp8-kv")[1]["kv_cache_scales"]
    for i in (0, 1):
        key, value = scales[f"decoder.layers.{i}.self_attention.core_attention"]
        factor = ours[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
        assert factor.dtype == torch.float32 and factor.shape == (1,)
        assert factor.item() == pytest.approx(max(key, value)) and key != value


def _nibbles_by_hand(packed: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's int4 layout undone: byte [j, i] holds row 2j (low) and 2j + 1 (high)."""
    low, high = (packed.to(torch.int16) & 0xF), ((packed.to(torch.int16) >> 4) & 0xF)
    rows = torch.stack((low, high), dim=1).reshape(-1, packed.shape[1])
    return torch.where(rows > 7, rows - 16, rows)


def test_trtllm_int4_checkpoint_packs_codes_and_group_scales_by_hand(runs):
    export_trtllm(runs / "a", runs / "trt-awq", log=lambda _: None)
    config = json.loads((runs / "trt-awq" / "config.json").read_text())["quantization"]
    assert config == {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": GROUP,
                      "has_zero_point": False, "pre_quant_scale": True,
                      "exclude_modules": ["lm_head"]}  # fmt: skip
    ours = _read_all(runs / "trt-awq" / "rank0.safetensors")
    packed, _ = read_packed(runs / "a")
    state = _model(runs / "a")[1]["model"]
    g, theirs = "decoder.layers.1", "transformer.layers.1"
    fused = {n: (unpack_int4(packed[f"{g}.{n}.weight_packed"], state[f"{g}.{n}.weight"].shape[1]),
                 packed[f"{g}.{n}.weight_scale"], state[f"{g}.{n}.weight"])
             for n in ("self_attention.linear_qkv", "mlp.linear_fc1")}  # fmt: skip
    by_hand = {
        "attention.qkv": [_trtllm_qkv(t) for t in fused["self_attention.linear_qkv"]],
        "mlp.fc": [t[:96] for t in fused["mlp.linear_fc1"]],  # gate: the activated half
        "mlp.gate": [t[96:] for t in fused["mlp.linear_fc1"]],  # up
    }
    for name, (codes, scales, fake_quantized) in by_hand.items():
        weight = ours[f"{theirs}.{name}.weight"]
        assert weight.dtype == torch.int8 and weight.shape == (codes.shape[0] // 2, codes.shape[1])
        assert torch.equal(_nibbles_by_hand(weight), codes.to(torch.int16)), name
        factor = ours[f"{theirs}.{name}.weights_scaling_factor"]
        assert factor.shape == (codes.shape[0], codes.shape[1] // GROUP)
        assert torch.equal(factor, scales)
        dequantized = _nibbles_by_hand(weight) * factor.repeat_interleave(GROUP, dim=1)
        assert torch.equal(dequantized, fake_quantized), name  # gigatron's fake quantization
        assert torch.equal(ours[f"{theirs}.{name}.prequant_scaling_factor"],
                           torch.ones(codes.shape[1]))  # fmt: skip
    norm = state[f"{g}.input_layernorm.weight"]  # AWQ's folded norm
    assert torch.equal(ours[f"{theirs}.input_layernorm.weight"], norm)


def test_trtllm_smoothquant_checkpoint_by_hand(runs):
    export_trtllm(runs / "sq", runs / "trt-sq", log=lambda _: None)
    config = json.loads((runs / "trt-sq" / "config.json").read_text())["quantization"]
    assert config["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    ours = _read_all(runs / "trt-sq" / "rank0.safetensors")
    packed, _ = read_packed(runs / "sq")
    g, theirs = "decoder.layers.1", "transformer.layers.1"
    fused = {n: (packed[f"{g}.{n}.weight_packed"], packed[f"{g}.{n}.weight_scale"])
             for n in ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")}  # fmt: skip
    by_hand = {
        "attention.qkv": [_trtllm_qkv(t) for t in fused["self_attention.linear_qkv"]],
        "attention.dense": fused["self_attention.linear_proj"],
        "mlp.fc": [t[:96] for t in fused["mlp.linear_fc1"]],  # gate: the activated half
        "mlp.gate": [t[96:] for t in fused["mlp.linear_fc1"]],  # up
        "mlp.proj": fused["mlp.linear_fc2"],
    }
    for name, (codes, scales) in by_hand.items():
        assert ours[f"{theirs}.{name}.weight"].dtype == torch.int8
        assert torch.equal(ours[f"{theirs}.{name}.weight"], codes), name
        assert torch.equal(ours[f"{theirs}.{name}.per_channel_scale"], scales.T), name  # [1, out]
    assert torch.equal(ours[f"{theirs}.attention.dense.smoother"], torch.ones(1, 64))
    assert torch.equal(ours[f"{theirs}.mlp.proj.smoother"], torch.ones(1, 96))
    assert f"{theirs}.attention.qkv.smoother" not in ours
    for norm in ("input_layernorm", "post_layernorm"):
        assert torch.equal(ours[f"{theirs}.{norm}.scale_to_int"], torch.ones(1))


def test_trtllm_checkpoint_of_int8_weights_holds_the_fake_quantized_weights(runs, capsys):
    assert gigatron_main(["quantize", "--load", str(runs / "ckpt"), "--method", "int8-weight",
                          "--group-size", str(GROUP), "--save", str(runs / "int8"),
                          "--hf-save", str(runs / "trt-int8"), "--export-format",
                          "trtllm"]) == 0  # fmt: skip
    assert "note: int8-weight is stored as its fake-quantized weights in float32" in (
        capsys.readouterr().out
    )  # fmt: skip
    config = json.loads((runs / "trt-int8" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] is None
    ours = _read_all(runs / "trt-int8" / "rank0.safetensors")
    fused = _model(runs / "int8")[1]["model"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(ours["transformer.layers.1.attention.qkv.weight"], _trtllm_qkv(fused))


def test_export_flags_that_would_go_unused_are_refused(runs, capsys):
    base = ["quantize", "--load", str(runs / "ckpt"), "--save", str(runs / "unused"),
            "--method", "int8-weight"]  # fmt: skip
    assert gigatron_main([*base, "--export-format", "trtllm"]) == 2
    assert "--export-format trtllm: give --hf-save DIR too" in capsys.readouterr().err
    argv = [*base, "--hf-save", str(runs / "unused-hf"), "--export-format", "trtllm",
            "--max-shard-size", "1GB"]  # fmt: skip
    assert gigatron_main(argv) == 2
    assert "--max-shard-size 1GB: shards a compressed-tensors --hf-save only" in (
        capsys.readouterr().err
    )  # fmt: skip
    assert gigatron_main([*base, "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype fp8: needs --calib-data" in capsys.readouterr().err
    assert not (runs / "unused").exists() and not (runs / "unused-hf").exists()
