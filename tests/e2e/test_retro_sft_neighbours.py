"""`gigatron retro-preprocess --retro-tasks query-sft` (tasks/retro_sft_neighbours.py): each
instruction line's "neighbours" are the texts of its prompt's nearest database chunks by brute
force over the saved embeddings (a Flat index), the written file trains with `pretrain retro
--sft`, and bad input is one line naming it."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from retro_generation_helpers import CHUNK, GPT2, NEIGHBOURS, RETRO, ReferenceRetro, build_setup

from gigatron.cli import main as cli
from gigatron.tasks import retro_sft_neighbours
from helpers import records, write_jsonl
from retro_data_helpers import gpt_tokenizer

LINES = [
    {"id": 7, "prompt": "The game began development in 2010, carrying over a large portion of "
     "the work done on Valkyria Chronicles II. Who developed it?", "response": " Sega."},
    {"messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where is the"},
        {"role": "assistant", "content": " river"},
        {"role": "user", "content": " Tower of London?"},
        {"role": "assistant", "content": " London."},
    ], "neighbours": ["replaced"]},
    {"prompt": "Valkyria", "response": " Chronicles"},  # shorter than a chunk
]  # fmt: skip
PROMPTS = [
    LINES[0]["prompt"],
    "Answer briefly." + "Where is the" + " river" + " Tower of London?",
    "Valkyria",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_setup(tmp_path_factory.mktemp("retro_sft_neighbours"))


def query(setup, *extra: str) -> int:
    return cli([
        "retro-preprocess", "--retro-tasks", "query-sft", "--retro-project-dir",
        str(setup.project), *GPT2, *extra,
    ])  # fmt: skip


def expected_neighbours(reference: ReferenceRetro, prompt: str) -> list[str]:
    """The texts of the brute-force nearest chunks (+ the next) of the prompt's last chunk."""
    tokenizer = gpt_tokenizer()
    found = reference.search(tokenizer.tokenize(prompt)[-CHUNK:])
    return [tokenizer.detokenize([int(t) for t in row if t != tokenizer.eod]) for row in found]


def test_neighbours_are_the_prompts_nearest_chunks_and_the_file_trains(
    setup, tmp_path, monkeypatch
):
    monkeypatch.setattr(retro_sft_neighbours, "BATCH_LINES", 2)  # a full batch, then the rest
    source = write_jsonl(tmp_path / "inst.jsonl", LINES)
    before = source.read_bytes()
    out = tmp_path / "inst.retro.jsonl"
    assert query(setup, "--sft-data", str(source), "--sft-output", str(out)) == 0
    assert source.read_bytes() == before  # the input is never touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inst.jsonl", "inst.retro.jsonl"]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == len(LINES)
    reference = ReferenceRetro(setup, None)
    for line, record, prompt in zip(LINES, written, PROMPTS):
        expected = expected_neighbours(reference, prompt)
        assert len(expected) == NEIGHBOURS and all(expected)
        assert record == {**line, "neighbours": expected}  # other fields kept
    assert written[0]["neighbours"] != written[2]["neighbours"]
    # the written file is instruction data with neighbours: one fine-tuning step from the
    # Retro checkpoint reads it
    metrics = tmp_path / "metrics.jsonl"
    flags = [f for f in RETRO if f != "--mock-data"]
    assert cli([
        "pretrain", "retro", *flags, "--sft", "--data-path", str(out), "--split", "100,0,0",
        "--load", str(setup.checkpoint), "--finetune", "--eval-iters", "0",
        "--data-cache-path", str(tmp_path / "cache"), "--no-progress-bar",
        "--metrics-file", str(metrics),
    ]) == 0  # fmt: skip
    losses = [r["lm_loss"] for r in records(metrics, "train")]
    assert len(losses) == 1 and math.isfinite(losses[0]) and losses[0] > 0


def _error(capsys, setup, *argv: str) -> str:
    assert query(setup, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_are_one_line_errors(setup, tmp_path, capsys):
    good = str(write_jsonl(tmp_path / "good.jsonl", LINES[:1]))
    out = str(tmp_path / "out.jsonl")
    files = ["--sft-data", good, "--sft-output", out]
    no_prompt = write_jsonl(
        tmp_path / "no_prompt.jsonl",
        [LINES[2], {"messages": [{"role": "assistant", "content": "Hi"}]}],
    )
    not_sft = write_jsonl(tmp_path / "not_sft.jsonl", [{"text": "Valkyria"}])
    unindexed = tmp_path / "unindexed"
    shutil.copytree(setup.project, unindexed, ignore=shutil.ignore_patterns("index"))
    cases = [
        (["--sft-data", good, "--sft-output", good], f"--sft-output {good}: is the --sft-data"),
        (["--sft-data", good], "query-sft needs --sft-data IN.jsonl and --sft-output"),
        (["--sft-data", good, "--sft-output", str(tmp_path / "no" / "o")], "/no/o: not a file"),
        (["--sft-data", good, "--sft-output", str(tmp_path)], "not a file in an existing"),
        (["--sft-data", str(tmp_path / "none.jsonl"), "--sft-output", out], "none.jsonl: not"),
        (["--sft-data", str(no_prompt), "--sft-output", out], "no_prompt.jsonl: line 2: no prompt"),
        (["--sft-data", str(not_sft), "--sft-output", out], "not_sft.jsonl: line 1: not an SFT"),
        ([*files, "--retro-project-dir", str(tmp_path / "nowhere")], "nowhere"),
        ([*files, "--retro-project-dir", str(unindexed)], "no filled index"),
        ([*files, "--data-path", good], "--data-path: not used by --retro-tasks query-sft"),
        ([*files, "--retro-gpt-chunk-length", "4"], "--retro-gpt-chunk-length: not used"),
        ([*files, "--retro-num-neighbors", "0"], "--retro-num-neighbors 0: must be >= 1"),
        ([*files, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], "config.json"),
    ]
    for argv, expected in cases:
        assert expected in _error(capsys, setup, *argv), argv
    assert not (tmp_path / "out.jsonl").exists()  # no half-written output
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    argv = ["--retro-tasks", "db-build", "--sft-data", good]
    assert cli(["retro-preprocess", "--retro-project-dir", str(setup.project), *argv]) == 2
    assert "--sft-data: read by --retro-tasks query-sft only" in capsys.readouterr().err
