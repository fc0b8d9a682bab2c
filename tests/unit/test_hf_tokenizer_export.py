"""`gigatron convert --to hf` writes the run's tokenizer as files `AutoTokenizer` loads (GPT-2
BPE, BERT WordPiece, a Hugging Face tokenizer), giving gigatron's token ids; without a usable
tokenizer the export is refused with the fix (or `--no-tokenizer` exports the weights alone)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from gigatron.checkpoint.hf_convert import hf_to_gigatron
from gigatron.checkpoint.torch_format import safe_load
from gigatron.cli import main as gigatron
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.tokenizers import build_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
GPT2 = {
    "tokenizer_type": "GPT2BPETokenizer",
    "vocab_file": str(DATA / "gpt2-vocab.json"),
    "merge_file": str(DATA / "gpt2-merges.txt"),
}
TEXT = "Hello world, this is Gigatron: a naïve café costs 12345 € — isn't it?\n  Spaces  too."


def _checkpoint(tmp_path: Path, tokenizer: dict[str, str] | None) -> Path:
    """A tiny GPT-2 shaped gigatron checkpoint (GPT-2's vocabulary size) whose run recorded
    `tokenizer`, as `pretrain` records it, and that was not imported from Hugging Face."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    release = hf_to_gigatron(tmp_path / "hf", tmp_path / "ckpt", log=lambda _: None)
    path = release / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load(path)
    del state["hf_config"]
    state["args"]["tokenizer"].update(tokenizer or {})
    torch.save(state, path)
    return tmp_path / "ckpt"


def _export(checkpoint: Path, save: Path, *flags: str) -> int:
    argv = ["convert", "--from", "gigatron", "--to", "hf", "--load", str(checkpoint)]
    return gigatron([*argv, "--save", str(save), *flags])


def test_gpt2_bpe_export_loads_with_auto_tokenizer_and_gives_the_same_ids(tmp_path):
    checkpoint = _checkpoint(tmp_path, GPT2)
    assert _export(checkpoint, tmp_path / "out") == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    kept = "generation_config.json"  # of the original model, kept by the import
    assert files == ["config.json", kept, "merges.txt", "model.safetensors",
                     "tokenizer_config.json", "vocab.json"]  # fmt: skip
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = build_tokenizer(TokenizerConfig(**GPT2))
    assert len(exported) == 50257 and exported.eos_token_id == ours.eod == 50256
    ids = exported.encode(TEXT)
    assert ids == ours.tokenize(TEXT) and len(ids) > 20
    assert exported.decode(ids) == TEXT
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.vocab_size == 50257


def test_bert_wordpiece_export_gives_the_same_ids(tmp_path):
    vocab = tmp_path / "bert-vocab.txt"
    shutil.copy(DATA / "bert-base-uncased-vocab.txt", vocab)
    checkpoint = _checkpoint(tmp_path, {})  # the tokenizer given as flags
    flags = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab)]
    assert _export(checkpoint, tmp_path / "out", *flags) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = build_tokenizer(
        TokenizerConfig(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(vocab))
    )
    ids = exported.encode(TEXT, add_special_tokens=False)
    assert ids == ours.tokenize(TEXT) and len(ids) > 15


def test_hugging_face_tokenizer_folder_is_copied(tmp_path):
    source = tmp_path / "tok"
    ours = build_tokenizer(TokenizerConfig(**GPT2))
    transformers.GPT2TokenizerFast(GPT2["vocab_file"], GPT2["merge_file"]).save_pretrained(source)
    checkpoint = _checkpoint(
        tmp_path, {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(source)}
    )
    assert _export(checkpoint, tmp_path / "out") == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        source / "tokenizer.json"
    ).read_bytes()
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported.encode(TEXT) == ours.tokenize(TEXT)


@pytest.mark.parametrize(
    "recorded, expected",
    [
        (None, "records no tokenizer"),
        ({"tokenizer_type": "NullTokenizer", "vocab_size": 50257}, "records no tokenizer"),
        (dict(GPT2, merge_file="/nowhere/merges.txt"), "--merge-file /nowhere/merges.txt is not"),
        (
            {"tokenizer_type": "TikTokenizer", "tokenizer_model": "x.tiktoken"},
            "TikTokenizer has no",
        ),
    ],
)
def test_export_without_a_usable_tokenizer_is_refused_with_the_fix(
    tmp_path, capsys, recorded, expected
):
    checkpoint = _checkpoint(tmp_path, recorded)
    assert _export(checkpoint, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert expected in err and "--no-tokenizer" in err and "--tokenizer-type" in err, err
    assert not (tmp_path / "out").exists()
    # The fix: the weights alone, or the tokenizer given as flags.
    assert _export(checkpoint, tmp_path / "alone", "--no-tokenizer") == 0
    assert sorted(p.name for p in (tmp_path / "alone").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"
    ]  # fmt: skip
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT2["vocab_file"]]
    assert _export(checkpoint, tmp_path / "given", *flags, "--merge-file", GPT2["merge_file"]) == 0
    assert (tmp_path / "given" / "merges.txt").is_file()


def test_tokenizer_flags_without_meaning_are_refused(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, GPT2)
    assert _export(checkpoint, tmp_path / "out", "--no-tokenizer", "--vocab-file", "v.json") == 2
    assert "--vocab-file: no meaning" in capsys.readouterr().err
