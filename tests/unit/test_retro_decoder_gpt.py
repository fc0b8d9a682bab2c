"""The InstructRetro decoder alone as a GPT (checkpoint/retro_decoder.py): `gigatron convert
--from gigatron --to gigatron --family gpt` keeps a retro checkpoint's decoder; loaded as
`generate` loads a gpt checkpoint, it gives the Retro model's logits with the gate closed."""

from __future__ import annotations

import torch
from test_retro_model import SEQ, inputs, logits, retro_cfg

from gigatron.checkpoint.formats import saved_header
from gigatron.checkpoint.torch_format import save_checkpoint
from gigatron.cli import main as cli
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.models.retro import RetroDecoderLayer, build_retro_model
from gigatron.parallel.context import ParallelContext
from hf_helpers import checkpoint_model

PCTX = ParallelContext.single()


def saved_retro(root):
    """A random 6-layer Retro model saved as `pretrain retro` saves it (NullTokenizer)."""
    cfg = retro_cfg()
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.vocab_size = "NullTokenizer", 95
    vocab = build_run_tokenizer(cfg).vocab_size
    (model,) = build_retro_model(cfg, PCTX, vocab_size=vocab)
    extra = {"gigatron_family": "retro"}
    save_checkpoint(root / "retro", 2, [model], None, None, PCTX, cfg, extra)
    return model.eval()


def convert(*flags: str) -> int:
    return cli(["convert", "--from", "gigatron", "--to", "gigatron", *flags])


def test_the_gpt_of_a_retro_checkpoint_has_the_closed_gate_logits(tmp_path):
    retro = saved_retro(tmp_path)
    assert convert("--family", "gpt", "--load", str(tmp_path / "retro"), "--save",
                   str(tmp_path / "gpt")) == 0  # fmt: skip
    header = saved_header(tmp_path / "gpt" / "iter_0000002")
    assert header["gigatron_family"] == "gpt"
    assert header["args"]["retro"]["retro_gpt_chunk_length"] == 64  # the default: not a retro run
    gpt = checkpoint_model(tmp_path / "gpt")
    assert not any(".cross_attention." in name for name, _ in gpt.named_parameters())
    names = {name for name, _ in retro.named_parameters()}
    kept = {name for name in names if "cross_attn" not in name and "cross_attention" not in name}
    assert {name for name, _ in gpt.named_parameters()} == kept
    tokens, neighbours = inputs(3)
    with torch.no_grad():
        got = gpt(tokens, torch.arange(SEQ).expand_as(tokens))
    open_gate = logits(retro, tokens, neighbours)
    assert not torch.allclose(got, open_gate, atol=1e-3)  # the cross-attention matters when open
    for layer in retro.decoder.layers.values():
        if isinstance(layer, RetroDecoderLayer):
            layer.gate = 0.0
    torch.testing.assert_close(got, logits(retro, tokens, neighbours), rtol=0, atol=1e-6)


def test_refused_conversions_are_one_line(tmp_path, capsys):
    saved_retro(tmp_path)
    gpt = tmp_path / "gpt"
    assert convert("--family", "gpt", "--load", str(tmp_path / "retro"), "--save", str(gpt)) == 0
    capsys.readouterr()
    cases = {
        ("--family", "gpt", "--load", str(gpt)): "holds a gpt checkpoint, not a retro one",
        ("--family", "bert", "--load", str(tmp_path / "retro")): "--family bert: --from gigatron",
    }
    for flags, message in cases.items():
        assert convert(*flags, "--save", str(tmp_path / "again")) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err
        assert not (tmp_path / "again").exists()
