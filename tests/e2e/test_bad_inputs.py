"""Each command fed its most common mistakes: a one-line error naming the input and the fix
(exit status 2), never a Python traceback."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from inference_helpers import DATA, save_tiny_checkpoint

from gigatron.cli import main


def run(capsys, *argv: str) -> str:
    """stderr of `gigatron argv...`, which must fail with status 2 and no traceback."""
    status = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bad_inputs") / "ckpt"
    save_tiny_checkpoint(directory)
    return directory


def _evaluate(capsys, checkpoint: Path, task: str, path: Path) -> str:
    return run(capsys, "evaluate", "--task", task, "--valid-data", path, "--load", checkpoint,
               "--device", "cpu", "--no-progress-bar")  # fmt: skip


def test_evaluate_mistakes(capsys, checkpoint, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "holds no passages" in _evaluate(capsys, checkpoint, "LAMBADA", empty)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"text": "a b c"}\n{"text": "caf\xe9 au lait"}\n')
    err = _evaluate(capsys, checkpoint, "LAMBADA", latin)
    assert "line 2 is not UTF-8 text" in err and "in UTF-8" in err
    number = tmp_path / "number.jsonl"
    number.write_text(json.dumps({"text": 42}) + "\n")
    assert "line 1: 'text' is 42, not a passage" in _evaluate(capsys, checkpoint, "LAMBADA", number)
    assert "too few to score" in _evaluate(capsys, checkpoint, "WIKITEXT103", empty)
    binary = tmp_path / "wiki.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert "not UTF-8 text" in _evaluate(capsys, checkpoint, "WIKITEXT103", binary)
    nul = tmp_path / "nul.tokens"
    nul.write_bytes(b"a b\x00c d\n" * 10)
    assert "a binary file" in _evaluate(capsys, checkpoint, "WIKITEXT103", nul)
    missing = _evaluate(capsys, checkpoint, "LAMBADA", tmp_path / "nowhere.jsonl")
    assert "no such file" in missing


def test_megatron_flags_that_differ_from_the_checkpoint(capsys, checkpoint, tmp_path):
    prompts = ["generate", "--load", checkpoint, "--prompt", "x", "--device", "cpu"]
    err = run(capsys, *prompts, "--hidden-size", "128", "--num-attention-heads", "4",
              "--tensor-model-parallel-size", "2", "--tokenizer-type", "GPT2BPETokenizer")  # fmt: skip
    assert "--hidden-size 128 (checkpoint: 64)" in err
    assert "--tensor-model-parallel-size 2 (checkpoint: 1)" in err
    assert "--num-attention-heads" not in err and "--tokenizer-type" not in err  # equal
    assert "choose one" in run(capsys, *prompts, "--fp16", "--bf16")
    latin = tmp_path / "prompts.txt"
    latin.write_bytes(b"caf\xe9\n")
    assert "not UTF-8 text" in run(capsys, *prompts[:3], "--prompts-file", latin)


def test_preprocess_mistakes(capsys, tmp_path):
    good = gzip.compress(b"".join(b'{"text": "1 2 3"}\n' for _ in range(3000)))
    (tmp_path / "truncated.jsonl.gz").write_bytes(good[:100])
    (tmp_path / "plain.jsonl.gz").write_text('{"text": "1 2 3"}\n')
    (tmp_path / "ok.jsonl").write_text('{"text": "1 2 3"}\n')
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--workers", "1"]

    def preprocess(name: str, prefix: Path) -> str:
        return run(capsys, "preprocess", "--input", tmp_path / name, "--output-prefix", prefix,
                   *tokenizer)  # fmt: skip

    assert "truncated or corrupt" in preprocess("truncated.jsonl.gz", tmp_path / "a")
    assert "not a gzip file" in preprocess("plain.jsonl.gz", tmp_path / "b")
    assert "cannot write in /proc" in preprocess("ok.jsonl", Path("/proc/out"))
    assert not list(tmp_path.glob("a_*")) and not list(tmp_path.glob("b_*"))  # nothing left
    assert "file not found" in preprocess("nowhere.jsonl", tmp_path / "c")


def test_finetune_on_a_tsv_that_is_not_utf8(capsys, tmp_path):
    tsv = tmp_path / "train.tsv"
    tsv.write_bytes((DATA / "glue-mnli-sample" / "dev_matched.tsv").read_bytes() + b"\xff\xfe\n")
    err = run(capsys, "finetune", "--task", "MNLI", "--num-layers", "2", "--hidden-size", "64",
              "--num-attention-heads", "4", "--seq-length", "64",
              "--max-position-embeddings", "128", "--tokenizer-type", "BertWordPieceLowerCase",
              "--vocab-file", DATA / "bert-base-uncased-vocab.txt", "--train-data", tsv,
              "--valid-data", tsv, "--epochs", "1", "--micro-batch-size", "2", "--lr", "1e-4",
              "--device", "cpu")  # fmt: skip
    assert "line 4 is not UTF-8 text" in err and "give a GLUE TSV file in UTF-8" in err


def test_plot(capsys, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"type": "train", "iteration": i, "lm_loss": 5.0 - 0.1 * i} for i in range(1, 9)]
    records.append({"type": "eval", "split": "valid", "iteration": 8, "lm_loss": 4.5})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(metrics), "--output", str(tmp_path / "loss.png")]) == 0
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert main(["plot", str(tmp_path)]) == 0  # a run directory: its metrics.jsonl, loss.png
    assert (tmp_path / "loss.png").stat().st_size > 5000
    capsys.readouterr()
    assert "no such metrics file" in run(capsys, "plot", tmp_path / "nowhere.jsonl")
    startup = tmp_path / "startup.jsonl"
    startup.write_text(json.dumps({"type": "startup", "world_size": 1}) + "\n")
    assert "no training or validation record" in run(capsys, "plot", startup)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    assert "not a JSON line" in run(capsys, "plot", text)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8 text" in run(capsys, "plot", binary)
    assert "a directory" in run(capsys, "plot", metrics, "--output", tmp_path)
