"""What a user sees on the command line: every family's --help, one-line errors for mistyped flags
(with the closest flags), and hints for the common mistakes (no torchrun, a dataset prefix
without its `_text_document` suffix)."""

from __future__ import annotations

import re

import pytest

from gigatron.cli import main as gigatron
from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.families import family_names


@pytest.mark.parametrize("family", family_names())
def test_pretrain_help_of_every_family_exits_0_and_shows_defaults(family, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gigatron(["pretrain", family, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(f"usage: gigatron pretrain {family}")
    # A flag whose help holds a literal % (argparse %-formats help text) and real defaults.
    assert "layer i is MoE when i % N == 0" in text
    assert "--hidden-size HIDDEN_SIZE" in text
    assert "(default: 10000)" in text  # --rotary-base
    assert "(default: 0.02)" in text  # --init-method-std


def test_finetune_help_exits_0_and_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gigatron(["finetune", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "i % N == 0" in text and "(default: 10000)" in text


def test_a_mistyped_flag_gives_one_line_with_the_closest_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gigatron(["pretrain", "gpt", "--hiden-size", "64"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("gigatron pretrain gpt: error: --hiden-size: unknown flag; did you mean ")
    assert re.search(r"did you mean --hidden-size\b", err)
    assert "`gigatron pretrain gpt --help` lists every flag" in err
    assert "usage:" not in err


def test_a_flag_far_from_every_other_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--zzzzqqqq"])
    err = capsys.readouterr().err
    assert "--zzzzqqqq: unknown flag (`gigatron --help` lists every flag)" in err


def test_tensor_parallelism_without_torchrun_suggests_it():
    argv = ["--num-attention-heads", "4", "--tensor-model-parallel-size", "2"]
    with pytest.raises(GigatronError, match=r"torchrun --nproc-per-node 2 -m gigatron\.cli"):
        parse_config(argv, world_size=1)
    # Under torchrun with the wrong count, the hint is about the sizes only.
    with pytest.raises(GigatronError) as error:
        parse_config(argv, world_size=3)
    assert "torchrun" not in str(error.value)


def test_a_data_path_without_text_document_suggests_the_dataset(tmp_path):
    from gigatron.data.builder import open_indexed_dataset
    from gigatron.data.indexed import IndexedDataset

    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    (tmp_path / "other.bin").write_bytes(b"")  # no .idx: not a dataset
    expected = str(tmp_path / "corpus_text_document")
    with pytest.raises(GigatronError) as error:
        open_indexed_dataset(str(tmp_path / "corpus"), "--data-path")
    assert str(error.value).endswith(f"; did you mean {expected}?")
    with pytest.raises(GigatronError, match=f"did you mean {re.escape(expected)}"):
        IndexedDataset(tmp_path / "corpus_text_documnet")
    with pytest.raises(GigatronError) as error:
        IndexedDataset(tmp_path / "zzz")
    assert "did you mean" not in str(error.value)
