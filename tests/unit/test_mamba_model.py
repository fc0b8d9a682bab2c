"""The mamba family's model: Hugging Face `Mamba2ForCausalLM` logits (random init from a small
config, nothing downloaded), the hybrid stack's layers, its FLOPs and its configuration rules."""

from __future__ import annotations

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.hybrid import AttentionLayer, MLPLayer, build_model
from gigatron.models.mamba import MambaLayer
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ, LAYERS = 99, 21, 2  # 21: not a multiple of the scan's chunk


def _hf_model(tied: bool) -> Mamba2ForCausalLM:
    torch.manual_seed(11)
    config = Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_heads=8, head_dim=16,
        n_groups=2, state_size=16, expand=2, chunk_size=8, tie_word_embeddings=tied,
    )  # fmt: skip
    model = Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # random norms, D, biases too: every tensor's map is tested
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _flags(values: dict, *extra: str) -> list[str]:
    keys = (
        "num_layers", "hidden_size", "num_attention_heads", "mamba_state_dim", "mamba_head_dim",
        "mamba_num_groups", "mamba_num_heads", "hybrid_layer_pattern", "normalization",
        "position_embedding_type",
    )  # fmt: skip
    argv = []
    for key in keys:
        argv += ["--" + key.replace("_", "-"), str(values[key])]
    if values["untie_embeddings_and_output_weights"]:
        argv.append("--untie-embeddings-and-output-weights")
    argv += ["--norm-epsilon", str(values["layernorm_epsilon"]), "--disable-bias-linear"]
    argv += ["--seq-length", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0"]
    return [*argv, "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "8", *extra]


def _relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("tied", [False, True])
def test_same_logits_as_hugging_face_mamba2_and_the_map_round_trips(tied):
    hf = _hf_model(tied)
    adapter = get_family("mamba").hf_adapter
    values = adapter.config_from_hf(hf.config)
    cfg = parse_config(_flags(values))
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    assert model.vocab_size == 104  # padded to a multiple of 8
    state = adapter.from_hf(hf.state_dict(), LAYERS, None, model.vocab_size)
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    model.eval()
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        logits = model(tokens, None)
    assert logits.shape == (3, SEQ, 104)
    assert _relative_error(logits[..., :VOCAB], expected) < 1e-4

    back = adapter.to_hf(model.state_dict(), LAYERS, None, VOCAB)
    reference = hf.state_dict()
    assert set(back) == set(reference)
    for name, tensor in back.items():
        assert torch.equal(tensor, reference[name]), name


def _hybrid_config(*extra: str):
    return parse_config(
        [
            "--hybrid-layer-pattern",
            "M-M*-M-",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--mamba-state-dim",
            "16",
            "--mamba-head-dim",
            "16",
            "--mamba-num-groups",
            "2",
            "--seq-length",
            "16",
            "--normalization",
            "RMSNorm",
            "--position-embedding-type",
            "rope",
            "--swiglu",
            "--disable-bias-linear",
            "--padded-vocab-size",
            "128",
            *extra,
        ]  # fmt: skip
    )


def test_the_pattern_chooses_each_layer():
    cfg = _hybrid_config()
    assert cfg.model.num_layers == 7  # from the pattern
    (model,) = build_model(cfg, ParallelContext.single())
    kinds = {MambaLayer: "M", AttentionLayer: "*", MLPLayer: "-"}
    assert "".join(kinds[type(layer)] for layer in model.decoder.layers.values()) == "M-M*-M-"
    names = {name for name, _ in model.named_parameters()}
    assert "decoder.layers.0.mixer.in_proj.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in names
    assert "decoder.layers.3.input_layernorm.weight" in names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names
    assert not any(name.startswith("decoder.layers.1.self_attention") for name in names)
    tokens = torch.randint(0, 100, (2, 16))
    logits = model(tokens, torch.arange(16).expand(2, 16))
    assert logits.shape == (2, 16, 128) and torch.isfinite(logits).all()


def test_ratios_allocate_the_layers():
    cfg = _hybrid_config("--hybrid-attention-ratio", "0.2")
    cfg.model.hybrid_layer_pattern, cfg.model.num_layers = None, 10
    (model,) = build_model(cfg, ParallelContext.single())
    assert model.hybrid_pattern == "MMM*MM*MMM"


def test_flops_count_each_layer_by_kind():
    cfg = _hybrid_config()
    flops = get_family("mamba").flops_per_iteration(cfg, 2, 128)
    h, s, ffn = 64, 16, cfg.model.ffn_hidden_size
    d_inner, n, groups, heads = 128, 16, 2, 8
    mamba = 2 * h * (2 * d_inner + 2 * groups * n + heads) + 7 * d_inner * n + 2 * d_inner * h
    attention = 2 * h * (3 * h) + 4 * s * h + 2 * h * h
    mlp = 2 * 3 * h * ffn
    per_token = 3 * mamba + attention + 3 * mlp + 2 * h * 128
    assert flops == 3 * per_token * 2 * s


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--context-parallel-size", "2"], "--context-parallel-size 2: Mamba layers"),
        (["--reset-attention-mask"], "--reset-attention-mask: Mamba layers"),
        (["--num-layers", "6"], "has 7 layers but --num-layers is 6"),
        (["--mamba-num-groups", "3"], "--mamba-num-groups 3"),
        (["--tensor-model-parallel-size", "4"], "does not divide the 2 Mamba groups"),
    ],
)
def test_family_rules(extra, message):
    with pytest.raises(GigatronError, match=message):
        get_family("mamba").validate(_hybrid_config(*extra))


def test_other_families_refuse_the_hybrid_flags():
    cfg = _hybrid_config()
    from gigatron.families.accepted import check_family_config

    with pytest.raises(GigatronError, match="--hybrid-layer-pattern: the gpt family"):
        check_family_config(get_family("gpt"), cfg)
    with pytest.raises(GigatronError, match="--hybrid-layer-pattern: the bert family"):
        check_family_config(get_family("bert"), cfg)
