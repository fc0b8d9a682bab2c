"""`gigatron quantize --method int4-awq` on a tiny random Llama (SwiGLU, RMSNorm, a few
outlier input channels) calibrated on a .bin/.idx dataset: the codes reproducible bit for bit,
each weight's error within half a (scaled) step, each layer's output error on the calibration
inputs at most round-to-nearest's, the folded model's logits equal to the unfolded hand model's,
and the compressed-tensors export's logits in transformers equal to gigatron's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from gigatron.checkpoint.hf_convert import hf_to_gigatron
from gigatron.checkpoint.torch_format import safe_load
from gigatron.cli import main as gigatron_main
from gigatron.config import config_from_dict
from gigatron.data.indexed import write_dataset
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.awq import layer_error
from gigatron.quantize.calibration import calibration_samples, collect_hessians
from gigatron.quantize.checkpoint import read_packed
from gigatron.quantize.folding import check_foldable
from gigatron.quantize.methods import METHODS
from gigatron.quantize.rtn import dequantize, quantize_weight, unpack_int4
from hf_helpers import llama_gqa_config, randomise

VOCAB, SEQ, GROUP, SIZE = 100, 16, 16, 8
OUTLIERS = [3, 17, 40]  # input channels the norms make large: AWQ protects them


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
    return directory


def _model(checkpoint):
    state = safe_load(next(checkpoint.glob("*/mp_rank_00/model_optim_rng.pt")))
    cfg = config_from_dict(state["args"])
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.load_state_dict(state["model"], strict=True)
    return model.eval(), state


def _effective(packed, layer, weight):
    """The weight the folded model computes with: Q(W s) / s, fc1's up rows times fc2's s."""
    codes = unpack_int4(packed[f"{layer}.weight_packed"], weight.shape[1])
    effective = dequantize(codes, packed[f"{layer}.weight_scale"], torch.float32)
    scale = packed.get(f"{layer}.awq_scale", torch.ones(weight.shape[1]))
    effective = effective / scale
    after = packed.get(f"{layer.removesuffix('fc1')}fc2.awq_scale")
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
    samples = calibration_samples(str(runs / "calib"), None, SEQ, SIZE, 1234)
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
