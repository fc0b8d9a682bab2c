"""`gigatron generate` and `gigatron serve` on a Retro checkpoint with `--retro-project-dir`:
greedy tokens equal a hand-assembled forward per token with brute-force neighbours (a Flat
index), the neighbours move the logits from the first position that sees them, serve answers
with generate's tokens, and missing or mismatched inputs are one-line errors."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace

import pytest
import requests
import torch
from inference_helpers import save_tiny_checkpoint, start_server, stop_server
from retro_generation_helpers import CHUNK, ReferenceRetro, build_setup

from gigatron.cli import main as cli
from gigatron.inference.load import load_for_inference
from retro_data_helpers import gpt_tokenizer

PROMPTS = [
    "The game began development in 2010, carrying over a large portion of the work done on "
    "Valkyria Chronicles II",
    "Valkyria",
]
STEPS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_setup(tmp_path_factory.mktemp("retro_generate"))


@pytest.fixture(scope="module")
def reference(setup):
    args = Namespace(load=str(setup.checkpoint), ckpt_step=None, device="cpu",
                     retro_project_dir=str(setup.project))  # fmt: skip
    loaded = load_for_inference(args)
    return ReferenceRetro(setup, loaded.chunks[0])


@pytest.fixture(scope="module")
def generated(setup):
    """generate's JSON records: greedy, two prompts in one batch, prompt log-probs."""
    out = setup.root / "generated.jsonl"
    prompts = [flag for prompt in PROMPTS for flag in ("--prompt", prompt)]
    flags = ["--greedy", "--max-tokens", str(STEPS), "--prompt-logprobs", "--output", str(out)]
    assert cli(["generate", *setup.flags(*prompts, *flags)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_greedy_tokens_equal_a_forward_with_brute_force_neighbours(generated, reference):
    tokenizer = gpt_tokenizer()
    for prompt, record in zip(PROMPTS, generated):
        ids = tokenizer.tokenize(prompt)
        assert record["prompt_tokens"] == ids
        assert record["tokens"] == reference.greedy(ids, STEPS, tokenizer.vocab_size)
    # the long prompt's chunks were retrieved; the short one completes a chunk while generating
    assert len(generated[0]["prompt_tokens"]) > 2 * CHUNK
    assert (
        len(generated[1]["prompt_tokens"]) < CHUNK < 1 + len(generated[1]["prompt_tokens"]) + STEPS
    )


def test_neighbours_move_the_logits_from_the_first_position_that_sees_them(generated, reference):
    record = generated[0]
    ids = record["prompt_tokens"]
    with_neighbours = torch.log_softmax(reference.logits(ids)[:, :50257], -1)
    without = torch.log_softmax(reference.logits(ids, empty=True)[:, :50257], -1)
    scored = torch.tensor(record["prompt_logprobs"])  # token t+1 given tokens 0..t
    targets = torch.tensor(ids[1:])
    expected = with_neighbours[:-1].gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(scored, expected, atol=1e-4, rtol=0)
    # position p sees the neighbours of chunk (p - m + 1) // m: none before m - 1
    gap = (with_neighbours - without).abs().amax(-1)
    assert gap[: CHUNK - 1].max() < 1e-5
    assert gap[CHUNK - 1 :].min() > 1e-3


def test_serve_answers_with_the_generated_tokens(setup, generated):
    process, url = start_server(setup.checkpoint, *setup.flags()[2:])
    try:
        body = {"prompts": PROMPTS, "tokens_to_generate": STEPS, "top_k": 1}
        answer = requests.put(url + "/api", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        for i, record in enumerate(generated):
            assert answer.json()["tokens"][i] == record["prompt_tokens"] + record["tokens"]
        body = {"prompt": PROMPTS[0], "max_tokens": STEPS, "temperature": 0}
        openai = requests.post(url + "/v1/completions", json=body, timeout=120).json()
        assert openai["choices"][0]["text"] == generated[0]["text"]
    finally:
        output = stop_server(process)
    assert "Traceback" not in output, output


def _error(capsys, *argv: str) -> str:
    assert cli(["generate", *argv, "--prompt", "Hello", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_missing_or_mismatched_inputs_are_one_line_errors(setup, tmp_path, capsys):
    load = ["--load", str(setup.checkpoint), "--device", "cpu"]
    assert "give --retro-project-dir" in _error(capsys, *load)
    missing = tmp_path / "nowhere"
    assert f"{missing}/config.json: not found" in _error(
        capsys, *load, "--retro-project-dir", str(missing)
    )
    assert "built for 2; give 2" in _error(capsys, *setup.flags("--retro-num-neighbors", "3"))
    assert "index-add with --retro-index-str 'IVF4,Flat'" in _error(
        capsys, *setup.flags("--retro-index-str", "IVF4,Flat")
    )
    no_index = tmp_path / "no_index"
    shutil.copytree(setup.project, no_index, ignore=shutil.ignore_patterns("index"))
    assert "no filled index; run `gigatron retro-preprocess" in _error(
        capsys, *load, "--retro-project-dir", str(no_index)
    )
    gpt = tmp_path / "gpt"
    save_tiny_checkpoint(gpt)
    err = _error(capsys, "--load", str(gpt), "--retro-project-dir", str(setup.project))
    assert "--retro-project-dir: the --load checkpoint is not a Retro model" in err
    moved = setup.root / "bert-moved"
    setup.bert.rename(moved)
    try:
        assert "that embedded the database is gone" in _error(capsys, *setup.flags())
    finally:
        moved.rename(setup.bert)
