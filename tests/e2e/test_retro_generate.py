"""`gigatron generate` and `gigatron serve` on a Retro checkpoint with `--retro-project-dir`:
greedy tokens equal a hand-assembled forward per token with brute-force neighbours (a Flat
index), the neighbours move the logits from the first position that sees them, serve answers
with generate's tokens, and missing or mismatched inputs are one-line errors; `gigatron
evaluate --task RETRO-QA` scores those greedy answers (one project and checkpoint for all)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from argparse import Namespace

import pytest
import requests
import torch
import uvicorn
from inference_helpers import free_port
from retro_generation_helpers import (
    CHUNK,
    CONTEXT,
    GPT2,
    ReferenceRetro,
    build_setup,
    save_untrained,
)

from gigatron.cli import main as cli
from gigatron.errors import GigatronError
from gigatron.inference import SamplingParams
from gigatron.inference.generate import build_parser as generate_parser
from gigatron.inference.load import build_engine, load_for_inference
from gigatron.tasks.qa_metrics import clean_prediction, exact_match, f1
from gigatron.tasks.retro_qa import qa_prompt, read_qa_file
from gigatron.tasks.retro_retrieval import attach_retrieval
from helpers import DATA
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
def loaded(setup):
    """The Retro checkpoint loaded once (the reference's model; attach_retrieval's input)."""
    args = Namespace(load=str(setup.checkpoint), ckpt_step=None, device="cpu",
                     retro_project_dir=str(setup.project))  # fmt: skip
    return load_for_inference(args)


@pytest.fixture(scope="module")
def reference(setup, loaded):
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
    # with the gate closed (--retro-attention-gate 0) the neighbours change nothing
    layers = [layer for layer in reference.model.decoder.layers.values() if hasattr(layer, "gate")]
    try:
        for layer in layers:
            layer.gate = 0.0
        closed = reference.logits(ids) - reference.logits(ids, empty=True)
    finally:
        for layer in layers:
            layer.gate = 1.0
    assert len(layers) == 1 and closed.abs().max() == 0


def test_serve_answers_with_the_generated_tokens(setup, generated, monkeypatch):
    """`gigatron serve` in this process: its uvicorn server runs in a thread while the test
    asks it, then is told to exit."""
    answers = {}
    port, serve_forever = free_port(), uvicorn.Server.run

    def run(server, sockets=None):
        thread = threading.Thread(target=serve_forever, args=(server, sockets))
        thread.start()
        try:
            deadline = time.monotonic() + 120
            while not server.started and thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            body = {"prompts": PROMPTS, "tokens_to_generate": STEPS, "top_k": 1}
            answers["api"] = requests.put(url + "/api", json=body, timeout=120).json()
            body = {"prompt": PROMPTS[0], "max_tokens": STEPS, "temperature": 0}
            answers["openai"] = requests.post(url + "/v1/completions", json=body, timeout=120)
        finally:
            server.should_exit = True
            thread.join()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert cli(["serve", *setup.flags("--port", str(port))]) == 0
    for i, record in enumerate(generated):
        assert answers["api"]["tokens"][i] == record["prompt_tokens"] + record["tokens"]
    assert answers["openai"].json()["choices"][0]["text"] == generated[0]["text"]


def _error(capsys, *argv: str) -> str:
    assert cli(["generate", *argv, "--prompt", "Hello", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_missing_inputs_are_one_line_errors(setup, tmp_path, capsys):
    load = ["--load", str(setup.checkpoint), "--device", "cpu"]
    assert "give --retro-project-dir" in _error(capsys, *load)
    missing = tmp_path / "nowhere"
    assert f"{missing}/config.json: not found" in _error(
        capsys, *load, "--retro-project-dir", str(missing)
    )
    # a command without retrieval flags (lm-eval, evaluate's other tasks) says which have them
    with pytest.raises(GigatronError, match="generate, serve and evaluate --task RETRO-QA run it"):
        load_for_inference(Namespace(load=str(setup.checkpoint), ckpt_step=None, device="cpu"))


def _refused(setup, loaded, *flags: str, load=None) -> str:
    """attach_retrieval's error for generate's flags (the loaded model reused)."""
    args = generate_parser().parse_args(["--prompt", "x", *setup.flags(*flags)])
    with pytest.raises(GigatronError) as error:
        attach_retrieval(dataclasses.replace(loaded, chunks=load or loaded.chunks), args)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_mismatched_inputs_are_refused(setup, loaded, tmp_path):
    assert "built for 2; give 2" in _refused(setup, loaded, "--retro-num-neighbors", "3")
    assert "index-add with --retro-index-str 'IVF4,Flat'" in _refused(
        setup, loaded, "--retro-index-str", "IVF4,Flat"
    )
    no_index = tmp_path / "no_index"
    shutil.copytree(setup.project, no_index, ignore=shutil.ignore_patterns("index"))
    assert "no filled index; run `gigatron retro-preprocess" in _refused(
        setup, loaded, "--retro-project-dir", str(no_index)
    )
    assert "--retro-project-dir: the --load checkpoint is not a Retro model" in _refused(
        setup, loaded, load=[torch.nn.Linear(1, 1)]
    )
    assert "not available when a Retro" in _refused(setup, loaded, "--inference-dynamic-batching")
    assert "--max-sequence-length 60: a Retro model with learned positions" in _refused(
        setup, loaded, "--max-sequence-length", "60"
    )
    moved = setup.root / "bert-moved"
    setup.bert.rename(moved)
    try:
        assert "that embedded the database is gone" in _refused(setup, loaded)
    finally:
        moved.rename(setup.bert)


def test_retro_qa_scores_the_greedy_answers_with_retrieval(setup, reference, tmp_path, capsys):
    sample, results, new = DATA / "retro-qa-wikitext2.jsonl", tmp_path / "qa.json", 6
    argv = ["evaluate", "--task", "RETRO-QA", "--valid-data", str(sample), "--out-seq-length",
            str(new), "--results-file", str(results), *setup.flags()]  # fmt: skip
    assert cli(argv) == 0
    result = json.loads(results.read_text())
    tokenizer, examples = gpt_tokenizer(), read_qa_file(str(sample))
    assert result["num_examples"] == len(result["predictions"]) == len(examples) == 5
    for example, row in zip(examples, result["predictions"]):
        ids = qa_prompt(example, 1, tokenizer, CONTEXT, new)
        expected = clean_prediction(tokenizer.detokenize(reference.greedy(ids, new, 50257)))
        assert row["prediction"] == expected
        assert row["exact_match"] == exact_match(expected, example.answers)
        assert row["f1"] == f1(expected, example.answers)
    assert result["exact_match"] == sum(r["exact_match"] for r in result["predictions"]) / 5
    assert result["f1"] == pytest.approx(sum(r["f1"] for r in result["predictions"]) / 5)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (
        f"validation results on RETRO-QA | exact match: {result['exact_match']:.4f} | "
        f"F1: {result['f1']:.4f} | examples: 5"
    )


def test_retro_qa_on_a_gpt_checkpoint_answers_without_retrieval(tmp_path):
    gpt = tmp_path / "gpt"
    save_untrained(gpt, "gpt", [*GPT2, "--mock-data", "--num-layers", "2", "--hidden-size", "32",
                                "--num-attention-heads", "4", "--seq-length", str(CONTEXT),
                                "--max-position-embeddings", str(CONTEXT), "--micro-batch-size",
                                "1", "--global-batch-size", "1", "--train-iters", "1", "--lr",
                                "1e-3", "--init-method-std", "0.3"])  # fmt: skip
    sample, results = DATA / "retro-qa-wikitext2.jsonl", tmp_path / "qa.json"
    argv = ["evaluate", "--task", "RETRO-QA", "--valid-data", str(sample), "--load", str(gpt),
            "--device", "cpu", "--out-seq-length", "3", "--results-file", str(results)]  # fmt: skip
    assert cli(argv) == 0
    predictions = [row["prediction"] for row in json.loads(results.read_text())["predictions"]]
    loaded = load_for_inference(Namespace(load=str(gpt), ckpt_step=None, device="cpu"))
    engine = build_engine(loaded.chunks, loaded.pctx, loaded.tokenizer)
    tokenizer, params = loaded.tokenizer, SamplingParams(max_tokens=3, temperature=0.0)
    prompts = [qa_prompt(e, 1, tokenizer, CONTEXT, 3) for e in read_qa_file(str(sample))]
    expected = [clean_prediction(c.text) for c in engine.generate(prompts, params)]
    assert predictions == expected and any(expected)
