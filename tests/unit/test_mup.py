"""µP (`--use-mup`): width-scaled init, the output and embedding multipliers, the attention scale,
the per-layer learning rates, and a coordinate check (activation scales flat across widths
64-512 after a few Adam steps, where the standard parametrization's grow with the width)."""

from __future__ import annotations

import math

import pytest
import torch

from gigatron.config.root import parse_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.mup import refuse_hf_export
from gigatron.models.transformer_config import TransformerConfig
from gigatron.optim.build import build_optimizer
from gigatron.optim.lr_schedule import build_lr_scheduler
from gigatron.parallel.context import ParallelContext

VOCAB = 128
BATCH = 8


def _argv(width: int, *extra: str, lr: float = 1e-2) -> list[str]:
    """A 2-layer GPT of `width` with 16 channels per head (the head count grows with the width)."""
    return [
        "--num-layers", "2", "--hidden-size", str(width), "--num-attention-heads",
        str(width // 16), "--seq-length", "16", "--max-position-embeddings", "16",
        "--vocab-size", str(VOCAB), "--position-embedding-type", "rope", "--normalization",
        "RMSNorm", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--lr", str(lr), "--lr-decay-style", "constant",
        "--train-iters", "10", "--micro-batch-size", str(BATCH), "--global-batch-size",
        str(BATCH), "--weight-decay", "0", *extra,
    ]  # fmt: skip


def _build(argv: list[str]):
    cfg = parse_config(argv)
    torch.manual_seed(0)
    return cfg, get_family("gpt").build_model(cfg, ParallelContext.single(), VOCAB)


def _std(param: torch.Tensor) -> float:
    return param.detach().float().std().item()


def test_init_attention_scale_and_multipliers():
    mup = ["--use-mup", "--mup-base-hidden-size", "64"]
    cfg, (model,) = _build(_argv(256, *mup))
    layer = model.decoder.layers["0"]
    # Hidden matrices: 0.02 / sqrt(256 / 64); residual outputs also / sqrt(2 * 2 layers).
    assert _std(layer.self_attention.linear_qkv.weight) == pytest.approx(0.01, rel=0.03)
    assert _std(layer.mlp.linear_fc2.weight) == pytest.approx(0.005, rel=0.03)
    # Embeddings and the output layer keep the base std.
    assert _std(model.embedding.word_embeddings.weight) == pytest.approx(0.02, rel=0.03)
    assert _std(model.output_layer.weight) == pytest.approx(0.02, rel=0.03)
    assert layer.self_attention.core_attention.scale == pytest.approx(1 / 16)  # 1 / kv_channels
    config = TransformerConfig.from_config(
        parse_config(_argv(256, *mup, "--mup-base-head-dim", "4"))
    )
    assert config.softmax_scale == pytest.approx(2 / 16)
    # Logits = output_layer(final hidden) * 64 / 256; the embedding output * --mup-embedding-mult.
    captured = {}
    model.decoder.register_forward_hook(lambda m, i, out: captured.__setitem__("h", out))
    model.embedding.register_forward_hook(lambda m, i, out: captured.__setitem__("e", out))
    tokens = torch.randint(0, VOCAB, (2, 16))
    logits = model(tokens, None)
    plain = model.output_layer(captured["h"], model.output_weight()).transpose(0, 1)
    torch.testing.assert_close(logits, plain * 0.25)
    _, (scaled,) = _build(_argv(256, *mup, "--mup-embedding-mult", "3"))
    scaled.load_state_dict(model.state_dict())
    hidden = {}
    scaled.decoder.register_forward_hook(lambda m, inputs, out: hidden.__setitem__("x", inputs[0]))
    scaled(tokens, None)
    torch.testing.assert_close(hidden["x"], captured["e"] * 3)


def test_without_mup_nothing_changes():
    _, (plain,) = _build(_argv(256))
    _, (base,) = _build(_argv(64, "--use-mup"))  # base width = the width: standard init
    assert _std(plain.decoder.layers["0"].self_attention.linear_qkv.weight) == pytest.approx(
        0.02, rel=0.03
    )
    assert _std(base.decoder.layers["0"].self_attention.linear_qkv.weight) == pytest.approx(
        0.02, rel=0.05
    )


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_per_layer_learning_rates(optimizer):
    mup = ["--use-mup", "--mup-base-hidden-size", "64", "--optimizer", optimizer]
    cfg, chunks = _build(_argv(256, *mup, "--adam-eps", "1e-8"))
    opt = build_optimizer(cfg, chunks, ParallelContext.single())
    build_lr_scheduler(cfg, opt).step(BATCH)
    rates = {}
    for group in opt.optimizer.param_groups:
        for param in group["params"]:
            rates[id(param)] = (group["lr"], group.get("eps"))
    model = chunks[0]
    qkv = rates[id(model.decoder.layers["0"].self_attention.linear_qkv.weight)]
    embedding = rates[id(model.embedding.word_embeddings.weight)]
    output = rates[id(model.output_layer.weight)]
    norm = rates[id(model.decoder.final_layernorm.weight)]
    if optimizer == "adam":  # hidden matrices: lr and eps / 4; the rest the base values
        assert qkv == (pytest.approx(0.0025), pytest.approx(2.5e-9))
        assert embedding == output == norm == (pytest.approx(0.01), pytest.approx(1e-8))
    else:  # SGD: vector-like parameters (embeddings, output, norms) lr * 4
        assert qkv[0] == pytest.approx(0.01)
        assert embedding[0] == output[0] == norm[0] == pytest.approx(0.04)


def test_refusals():
    with pytest.raises(GigatronError, match="add --use-mup"):
        parse_config(_argv(64, "--mup-output-mult", "0.5"))
    for extra in (["--num-experts", "2"], ["--optimizer", "muon"], ["--save-hf", "hf"]):
        with pytest.raises(GigatronError, match="µP is implemented for dense GPT"):
            _build(_argv(64, "--use-mup", *extra))
    refuse_hf_export(parse_config(_argv(64)), "ckpt")  # a standard model exports
    with pytest.raises(GigatronError, match="ckpt: a µP model"):
        refuse_hf_export(parse_config(_argv(64, "--use-mup")), "ckpt")


def _coordinates(width: int, mup: bool, steps: int = 3) -> dict[str, float]:
    """RMS of the embedding output, each layer's output and the logits after `steps` Adam steps
    (lr 1e-2) on one fixed batch; µP's base width is 64."""
    extra = ["--use-mup", "--mup-base-hidden-size", "64"] if mup else []
    cfg, chunks = _build(_argv(width, *extra))
    model = chunks[0]
    opt = build_optimizer(cfg, chunks, ParallelContext.single())
    schedule = build_lr_scheduler(cfg, opt)
    tokens = torch.randint(0, VOCAB, (BATCH, 17), generator=torch.Generator().manual_seed(1))
    acts = {}
    model.embedding.register_forward_hook(lambda m, i, out: acts.__setitem__("embedding", out))
    for name, layer in model.decoder.layers.items():
        layer.register_forward_hook(lambda m, i, out, n=name: acts.__setitem__(f"layer{n}", out))
    for _ in range(steps):
        schedule.step(BATCH)
        logits = model(tokens[:, :-1], None)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acts["logits"] = model(tokens[:, :-1], None)
    return {key: value.float().pow(2).mean().sqrt().item() for key, value in acts.items()}


def _slope(small: float, large: float, widths: tuple[int, int]) -> float:
    """d log(scale) / d log(width)."""
    return math.log(large / small) / math.log(widths[1] / widths[0])


def test_coordinate_check():
    """Under µP every activation's RMS stays within a factor 2.5 from width 64 to 512 (the
    theory's limit is flat; at these finite widths, after 3 steps, the measured spread is at most
    2.05: a slope d log(scale) / d log(width) of -0.34 for the hidden layers, whose early updates
    still carry a width-dependent part), while the standard parametrization's hidden activations
    grow about as width^2 (Adam moves a matrix's output in proportion to its fan-in; measured 60x,
    slope 2.0, asserted > 1.5)."""
    mup = {width: _coordinates(width, True) for width in (64, 128, 256, 512)}
    for key in mup[64]:
        scales = [mup[width][key] for width in (64, 128, 256, 512)]
        assert max(scales) / min(scales) < 2.5, (key, scales)
    standard = {width: _coordinates(width, False) for width in (64, 512)}
    assert _slope(standard[64]["layer1"], standard[512]["layer1"], (64, 512)) > 1.5
