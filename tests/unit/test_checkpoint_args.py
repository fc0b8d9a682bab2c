"""config/checkpoint_args.py: Megatron's model/parallel/tokenizer/precision flags given to a
command that reads a checkpoint, checked against the checkpoint's saved configuration."""

from __future__ import annotations

import argparse

import pytest

from gigatron.config import GigatronConfig
from gigatron.config.checkpoint_args import add_checkpoint_arguments, apply_checkpoint_flags
from gigatron.errors import GigatronError


def _saved() -> GigatronConfig:
    cfg = GigatronConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2, 64, 4
    cfg.model.seq_length, cfg.model.max_position_embeddings = 64, None
    cfg.tokenizer.tokenizer_type = "GPT2BPETokenizer"
    return cfg


def _parse(*argv: str, skip: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_checkpoint_arguments(parser, skip=skip)
    return parser.parse_args(list(argv))


def test_equal_is_fine_absent_is_used_precision_selects_the_dtype():
    cfg = _saved()
    args = _parse("--num-layers", "2", "--hidden-size", "64", "--tokenizer-type",
                  "GPT2BPETokenizer", "--max-position-embeddings", "128", "--fp16",
                  "--no-load-optim", "--no-load-rng", "--log-interval", "10")  # fmt: skip
    apply_checkpoint_flags(cfg, args)
    assert cfg.model.max_position_embeddings == 128  # the checkpoint did not record it
    assert (cfg.training.fp16, cfg.training.bf16) == (True, False)
    apply_checkpoint_flags(cfg, _parse("--bf16"))
    assert (cfg.training.fp16, cfg.training.bf16) == (False, True)
    untouched = _saved()
    apply_checkpoint_flags(untouched, _parse())
    assert untouched.model.hidden_size == 64 and not untouched.training.fp16


def test_every_difference_is_named_with_both_values():
    args = _parse("--num-layers", "24", "--hidden-size", "64", "--num-attention-heads", "16",
                  "--tensor-model-parallel-size", "2", "--swiglu")  # fmt: skip
    with pytest.raises(GigatronError) as error:
        apply_checkpoint_flags(_saved(), args)
    message = str(error.value)
    assert "--num-layers 24 (checkpoint: 2)" in message
    assert "--num-attention-heads 16 (checkpoint: 4)" in message
    assert "--tensor-model-parallel-size 2 (checkpoint: 1)" in message
    assert "--swiglu True (checkpoint: False)" in message
    assert "--hidden-size" not in message


def test_only_and_skip():
    cfg = _saved()
    apply_checkpoint_flags(cfg, _parse("--seq-length", "32"), only=("num_layers",))
    assert cfg.model.seq_length == 64
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--seq-length", type=int)  # the command's own (evaluate's window)
    add_checkpoint_arguments(parser, skip=("seq_length",))
    apply_checkpoint_flags(cfg, parser.parse_args(["--seq-length", "32"]))  # not checked
    with pytest.raises(GigatronError, match="choose one"):
        apply_checkpoint_flags(_saved(), _parse("--fp16", "--bf16"))
    with pytest.raises(SystemExit):
        _parse("--lr", "1e-3")  # training flags are not accepted
