"""The Retro model (models/retro.py): Megatron's layer placement, chunk layouts, causality, the
attention gate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.errors import GigatronError
from gigatron.models.gpt import build_model as build_gpt
from gigatron.models.retro import (
    RetroDecoderLayer,
    RetroModel,
    RetroSpec,
    build_retro_model,
    from_chunks,
    retro_layer_numbers,
    to_chunks,
)
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ, CHUNK, NEIGHBOURS = 96, 16, 4, 2


def retro_cfg(num_layers: int = 6, gate: float = 1.0, **model) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = num_layers, 32, 4, SEQ
    m.attention_dropout = m.hidden_dropout = 0.0
    for key, value in model.items():
        setattr(m, key, value)
    r = cfg.retro
    r.retro_gpt_chunk_length, r.retro_num_neighbors, r.retro_attention_gate = CHUNK, 2, gate
    r.retro_encoder_hidden_dropout = r.retro_encoder_attention_dropout = 0.0
    return finalize_config(cfg)


def inputs(seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    neighbours = torch.randint(0, VOCAB, (batch, SEQ // CHUNK, NEIGHBOURS, 2 * CHUNK), generator=g)
    return tokens, neighbours


def logits(model, tokens, neighbours) -> torch.Tensor:
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, neighbour_tokens=neighbours)


def test_retro_layers_follow_megatrons_placement():
    assert retro_layer_numbers(6) == [6]
    assert retro_layer_numbers(12) == [6, 9, 12]
    assert retro_layer_numbers(15) == [6, 9, 12, 15]
    assert retro_layer_numbers(24) == [9, 12, 15, 18, 21, 24]
    with pytest.raises(GigatronError, match="--num-layers 4: a Retro decoder needs at least 6"):
        retro_layer_numbers(4)
    (model,) = build_retro_model(retro_cfg(9), ParallelContext.single(), vocab_size=VOCAB)
    layers = model.decoder.layers
    kinds = [isinstance(layers[str(i)], RetroDecoderLayer) for i in range(9)]
    assert kinds == [False] * 5 + [True, False, False, True]
    assert layers["5"].cross_attention.encoder is not None
    assert layers["8"].cross_attention.encoder is None
    assert len(layers["5"].cross_attention.encoder.layers) == 2


def test_chunk_layout_round_trip():
    x = torch.arange(2 * 12 * 3, dtype=torch.float32).reshape(12, 2, 3)  # [s, b, d]
    chunks = to_chunks(x, 4)  # [m, b*l, d]
    assert chunks.shape == (4, 6, 3)
    # batch row b * l + j holds chunk j of sample b.
    assert torch.equal(chunks[:, 1 * 3 + 2], x[8:12, 1])
    assert torch.equal(from_chunks(chunks, 2), x)


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_causality(position_embedding_type):
    cfg = retro_cfg(position_embedding_type=position_embedding_type)
    (model,) = build_retro_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.eval()
    tokens, neighbours = inputs()
    base = logits(model, tokens, neighbours)
    # New neighbours for chunk k: the first position that may see them is k*m + m - 1 (the last
    # token of chunk k, whose text retrieved them); every logit before it is unchanged.
    for chunk in range(SEQ // CHUNK):
        changed = neighbours.clone()
        changed[:, chunk] = (changed[:, chunk] + 7) % VOCAB
        out = logits(model, tokens, changed)
        first = chunk * CHUNK + CHUNK - 1
        torch.testing.assert_close(out[:, :first], base[:, :first], rtol=0, atol=0)
        assert (out[:, first] - base[:, first]).abs().max() > 1e-4
    # New text after position p changes no logit up to p.
    for p in (0, 3, 5, 12):
        changed = tokens.clone()
        changed[:, p + 1 :] = (changed[:, p + 1 :] + 11) % VOCAB
        out = logits(model, changed, neighbours)
        torch.testing.assert_close(out[:, : p + 1], base[:, : p + 1], rtol=0, atol=0)
        assert (out[:, p + 1] - base[:, p + 1]).abs().max() > 1e-4


def test_closed_gate_gives_the_gpt_of_the_same_weights():
    pctx = ParallelContext.single()
    (retro,) = build_retro_model(retro_cfg(gate=0.0), pctx, vocab_size=VOCAB)
    (gpt,) = build_gpt(retro_cfg(), pctx, vocab_size=VOCAB)
    missing, unexpected = gpt.load_state_dict(retro.state_dict(), strict=False)
    assert not missing and all(".cross_attention." in k or "cross_attn" in k for k in unexpected)
    tokens, neighbours = inputs(1)
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        expected = gpt(tokens, positions)
    torch.testing.assert_close(logits(retro.eval(), tokens, neighbours), expected)
    # The open gate does use the neighbours.
    (opened,) = build_retro_model(retro_cfg(gate=1.0), pctx, vocab_size=VOCAB)
    assert (logits(opened.eval(), tokens, neighbours) - expected).abs().max() > 1e-3


def test_wrong_neighbour_shape_is_refused():
    (model,) = build_retro_model(retro_cfg(), ParallelContext.single(), vocab_size=VOCAB)
    tokens, neighbours = inputs()
    with pytest.raises(GigatronError, match=r"neighbour tokens \(2, 4, 2, 4\) for 16 tokens"):
        logits(model, tokens, neighbours[..., :4])


# ---- Megatron-Core 0.12.3's RetroModel (tests/data/retro-fixture, tests/tools/make_retro_fixture.py)
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "retro-fixture"


def megatron_to_gigatron(name: str) -> str:
    """Megatron-Core's Retro parameter name -> gigatron's (the encoder's first MLP norm is
    wrapped per neighbour in Megatron-Core; gigatron's is the plain norm)."""
    return name.replace("pre_mlp_layernorm.norm.", "pre_mlp_layernorm.")


def test_logits_equal_megatron_core_retro_model():
    shape = json.loads((FIXTURE / "config.json").read_text())
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size = shape["num_layers"], shape["hidden_size"]
    m.num_attention_heads, m.ffn_hidden_size = (
        shape["num_attention_heads"],
        shape["ffn_hidden_size"],
    )
    m.seq_length, m.untie_embeddings_and_output_weights = shape["seq_length"], True
    m.attention_dropout = m.hidden_dropout = 0.0
    r = cfg.retro
    r.retro_gpt_chunk_length, r.retro_num_neighbors = shape["chunk_length"], shape["num_neighbors"]
    r.retro_num_retrieved_chunks = shape["num_retrieved_chunks"]
    r.retro_encoder_hidden_dropout = r.retro_encoder_attention_dropout = 0.0
    vocab = shape["vocab_size"]
    config = TransformerConfig.from_config(finalize_config(cfg))
    # Megatron-Core 0.12.3's Retro has no final norm (gigatron's default keeps the GPT's).
    spec = dataclasses.replace(RetroSpec.from_config(cfg), final_norm=False)
    model = RetroModel(config, ParallelContext.single(), vocab, spec)
    weights = {
        megatron_to_gigatron(k.removeprefix("weights/")): v
        for k, v in tensors.items()
        if k.startswith("weights/")
    }
    assert set(weights) == set(model.state_dict())
    model.load_state_dict(weights)
    tokens, neighbours = tensors["tokens"], tensors["neighbour_tokens"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out = model.eval()(tokens, positions, neighbour_tokens=neighbours)
    torch.testing.assert_close(out, tensors["logits"], rtol=0, atol=1e-5)


def test_family_refuses_what_retro_cannot_do():
    from gigatron.families import get_family

    validate = get_family("retro").validate
    cfg = retro_cfg()
    cfg.data.mock_data = True
    validate(cfg)
    problems = {
        "--retro-gpt-chunk-length 5 does not divide --seq-length 16": (
            "retro",
            "retro_gpt_chunk_length",
            5,
        ),
        "virtual pipeline stages: not built for Retro": (
            "parallel",
            "num_virtual_stages_per_pipeline_rank",
            2,
        ),
        "--recompute-granularity full: not built for Retro": (
            "model",
            "recompute_granularity",
            "full",
        ),
    }
    for message, (section, field, value) in problems.items():
        bad = retro_cfg()
        bad.data.mock_data = True
        setattr(getattr(bad, section), field, value)
        with pytest.raises(GigatronError, match=message.replace("(", r"\(")):
            validate(bad)
    # where the neighbours come from is checked when a run builds its data (a checkpoint
    # converted or resharded is read without its data flags)
    from gigatron.families.retro.dataset import check_neighbour_source

    bad = retro_cfg()
    validate(bad)
    with pytest.raises(GigatronError, match="no --retro-project-dir"):
        check_neighbour_source(bad)


def test_pipeline_stages_pass_embedded_then_encoded_neighbours():
    from types import SimpleNamespace

    from gigatron.families import get_family

    stage_shapes = get_family("retro").pipeline_stage_shapes
    pctx = SimpleNamespace(pp_size=2, tp_size=1)
    # micro-batch 1: l = SEQ / CHUNK chunk rows; r = 2 * CHUNK tokens per neighbour, k = 2.
    hidden, chunks, r = (SEQ, 1, 32), SEQ // CHUNK, 2 * CHUNK
    cfg = retro_cfg(6)
    cfg.training.micro_batch_size = 1
    # 6 layers over 2 stages: the encoder's layer 6 is on stage 1, so stage 0 sends embedded ones.
    assert stage_shapes(cfg, pctx)(0) == [hidden, (r, chunks * 2, 32)]
    cfg = retro_cfg(9)
    cfg.training.micro_batch_size = 1
    cfg.parallel.decoder_first_pipeline_num_layers = 6
    assert stage_shapes(cfg, pctx)(0) == [hidden, (r * 2, chunks, 32)]
