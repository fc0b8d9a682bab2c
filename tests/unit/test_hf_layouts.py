"""Hugging Face checkpoints as published: base models without a head (`BertModel` in the shape of
all-MiniLM-L6-v2, `LlamaModel`, `MistralModel`, `Qwen2Model`) and sentence-transformers folders
convert with `gigatron convert --from hf`; the gigatron model's hidden states equal the
`transformers` model's, the heads the checkpoint lacks are initialised and named in one warning,
and tensors no mapping knows are refused with their names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gigatron.checkpoint.torch_format import safe_load
from gigatron.cli import main as gigatron
from gigatron.config import config_from_dict
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ = 1000, 24
# all-MiniLM-L6-v2's shape (its vocabulary cut to VOCAB to stay fast).
MINILM = dict(
    vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
    intermediate_size=1536, max_position_embeddings=512, hidden_act="gelu",
)  # fmt: skip
SMALL_DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


def _save(model, folder: Path) -> None:
    torch.manual_seed(3)
    with torch.no_grad():  # every tensor drawn (transformers starts norms and biases at 1 and 0)
        for param in model.parameters():
            param.normal_(0.0, 0.05).add_(1.0 if param.dim() == 1 else 0.0)
    model.eval().save_pretrained(folder)


def _sentence_transformers(folder: Path, subfolder: str) -> Path:
    """A sentence-transformers folder around the BertModel in `folder` (as the package writes
    it: the Transformer module in `subfolder`, "" in newer versions)."""
    st = folder.parent / f"st{subfolder or '-root'}"
    shutil.copytree(folder, st / subfolder, dirs_exist_ok=True)
    modules = [dict(m, path=subfolder) if m["idx"] == 0 else m for m in MODULES]
    (st / "modules.json").write_text(json.dumps(modules))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 384}')
    (st / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    return st


def _convert(load: Path, save: Path, capsys) -> str:
    assert gigatron(["convert", "--from", "hf", "--to", "gigatron", "--load", str(load),
                     "--save", str(save)]) == 0  # fmt: skip
    return capsys.readouterr().err


def _gigatron_model(save: Path):
    state = safe_load(save / "release" / "mp_rank_00" / "model_optim_rng.pt")
    cfg = config_from_dict(state["args"])
    family = get_family(state["gigatron_family"])
    (model,) = family.build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.load_state_dict(state["model"], strict=True)
    return model.eval(), state["model"]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("layout", ["BertModel", "sentence-transformers", "st-0_Transformer"])
def test_minilm_shaped_bert_model_gives_the_same_hidden_states(tmp_path, capsys, layout):
    hf = transformers.BertModel(transformers.BertConfig(**MINILM), add_pooling_layer=True)
    _save(hf, tmp_path / "hf")
    assert "embeddings.word_embeddings.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    load = {
        "BertModel": tmp_path / "hf",
        "sentence-transformers": _sentence_transformers(tmp_path / "hf", ""),
        "st-0_Transformer": _sentence_transformers(tmp_path / "hf", "0_Transformer"),
    }[layout]
    if layout == "st-0_Transformer":
        assert not (load / "config.json").exists()
    err = _convert(load, tmp_path / "ckpt", capsys)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "BertModel" in warnings[0], err
    assert "cls.predictions.bias" in warnings[0] and "cls.seq_relationship.weight" in warnings[0]
    assert "pooler" not in warnings[0]  # the checkpoint has it

    model, state = _gigatron_model(tmp_path / "ckpt")
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).last_hidden_state
        positions = torch.arange(SEQ).expand(2, SEQ)
        hidden = model.encode(tokens, positions, None, torch.zeros_like(tokens)).transpose(0, 1)
    assert (hidden - expected).abs().max().item() < 1e-5
    assert torch.equal(state["pooler.weight"], hf.pooler.dense.weight)
    # The missing heads as transformers initialises them.
    assert not state["output_layer.bias"].any()
    assert torch.equal(state["lm_head.layer_norm.weight"], torch.ones(384))
    assert 0.015 < state["lm_head.dense.weight"].std().item() < 0.025


def test_bert_without_pooler_gets_one_and_says_so(tmp_path, capsys):
    config = transformers.BertConfig(**dict(MINILM, num_hidden_layers=1, hidden_size=64,
                                            num_attention_heads=4, intermediate_size=128))  # fmt: skip
    _save(transformers.BertModel(config, add_pooling_layer=False), tmp_path / "hf")
    err = _convert(tmp_path / "hf", tmp_path / "ckpt", capsys)
    assert "bert.pooler.dense.weight" in err and "bert.pooler.dense.bias" in err
    _, state = _gigatron_model(tmp_path / "ckpt")
    assert not state["pooler.bias"].any()


def _decoder_config(kind: str, tied: bool):
    if kind == "GPT2Model":  # always tied
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4)
    config_class = getattr(transformers, kind.replace("Model", "Config"))
    return config_class(**SMALL_DECODER, tie_word_embeddings=tied)


@pytest.mark.parametrize(
    "kind, tied",
    [("LlamaModel", False), ("MistralModel", False), ("Qwen2Model", False), ("Qwen2Model", True),
     ("GPT2Model", True)],
)  # fmt: skip
def test_decoder_base_models_give_the_same_hidden_states(tmp_path, capsys, kind, tied):
    hf = getattr(transformers, kind)(_decoder_config(kind, tied))
    _save(hf, tmp_path / "hf")
    names = load_file(tmp_path / "hf" / "model.safetensors")
    prefix, embedding = (
        ("transformer.", "wte") if kind == "GPT2Model" else ("model.", "embed_tokens")
    )
    assert f"{embedding}.weight" in names and not any(n.startswith(prefix) for n in names)
    err = _convert(tmp_path / "hf", tmp_path / "ckpt", capsys)
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warned) == (0 if tied else 1), err
    assert all(kind in line and "lm_head.weight" in line for line in warned)

    model, state = _gigatron_model(tmp_path / "ckpt")
    assert ("output_layer.weight" in state) == (not tied)
    tokens = _tokens()
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        expected = hf(tokens).last_hidden_state
        rotary = model.rotary(positions) if model.rotary is not None else None
        hidden = model.decoder(model.embedding(tokens, positions), None, rotary).transpose(0, 1)
    assert (hidden - expected).abs().max().item() < 1e-5
    if not tied:
        assert 0.015 < state["output_layer.weight"][:VOCAB].std().item() < 0.025


def test_tensors_no_mapping_knows_are_refused_by_name(tmp_path, capsys):
    config = transformers.BertConfig(**dict(MINILM, num_hidden_layers=1, hidden_size=64,
                                            num_attention_heads=4, intermediate_size=128))  # fmt: skip
    _save(transformers.BertModel(config), tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights.update({"classifier.weight": torch.zeros(3, 64), "classifier.bias": torch.zeros(3)})
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    code = gigatron(["convert", "--from", "hf", "--to", "gigatron", "--load",
                     str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "2 tensor(s) gigatron has no place for" in err
    assert "classifier.weight" in err and "classifier.bias" in err
    assert "bert.classifier" not in err  # named as stored
    assert not (tmp_path / "ckpt").exists()
