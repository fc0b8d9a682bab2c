"""`gigatron generate` from a saved checkpoint: the same tokens as the engine in-process, and the
same tokens at tensor-parallel 2 and pipeline-parallel 2 (torchrun) as at 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_helpers import engine_from_checkpoint, save_tiny_checkpoint

from gigatron.checkpoint.convert import convert_checkpoint
from gigatron.inference import SamplingParams
from helpers import gigatron, records

PROMPTS = ["The quick brown fox", "Hello", "In 1999, the city of Paris had"]


def run_generate(load: Path, output: Path, *flags: str, nproc: int = 1):
    prompt_flags = [item for prompt in PROMPTS for item in ("--prompt", prompt)]
    gigatron("generate", "--load", str(load), "--device", "cpu", *prompt_flags,
             "--output", str(output), *flags, nproc=nproc, timeout=240)  # fmt: skip
    return records(output)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("generate") / "ckpt"
    save_tiny_checkpoint(directory)
    return directory


GREEDY = ["--greedy", "--max-tokens", "10", "--max-batch-size", "2", "--ignore-eos"]
SAMPLED = ["--temperature", "0.9", "--top-k", "20", "--sampling-seed", "3", "--max-tokens", "10",
           "--ignore-eos", "--logprobs"]  # fmt: skip


def test_generate_matches_the_engine_in_process(checkpoint, tmp_path):
    records = run_generate(checkpoint, tmp_path / "out.jsonl", *GREEDY)
    engine, tokenizer = engine_from_checkpoint(checkpoint)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate([tokenizer.tokenize(p) for p in PROMPTS], params)
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["tokens"] for r in records] == [c.output_ids for c in expected]
    assert [r["text"] for r in records] == [tokenizer.detokenize(c.output_ids) for c in expected]
    assert all(len(r["tokens"]) == 10 and r["finish_reason"] == "length" for r in records)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[dict]]:
    return {
        "greedy": run_generate(checkpoint, checkpoint.parent / "g1.jsonl", *GREEDY),
        "sampled": run_generate(checkpoint, checkpoint.parent / "s1.jsonl", *SAMPLED),
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_give_the_same_tokens(checkpoint, reference, tmp_path, tp, pp):
    split = tmp_path / f"tp{tp}pp{pp}"
    convert_checkpoint(checkpoint, split, tp, pp)
    for name, flags in (("greedy", GREEDY), ("sampled", SAMPLED)):
        records = run_generate(split, tmp_path / f"{name}.jsonl", *flags, nproc=tp * pp)
        assert [r["tokens"] for r in records] == [r["tokens"] for r in reference[name]]
        if name == "sampled":
            for got, want in zip(records, reference[name]):
                torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-4, rtol=0)


def test_torch_dist_checkpoint_generates_the_same_tokens_at_any_tp(reference, tmp_path):
    # A torch_dist checkpoint loads at tensor-parallel = the process count: no conversion.
    save_tiny_checkpoint(tmp_path / "dist", ckpt_format="torch_dist")
    for nproc in (1, 2):
        records = run_generate(tmp_path / "dist", tmp_path / f"{nproc}.jsonl", *GREEDY, nproc=nproc)
        assert [r["tokens"] for r in records] == [r["tokens"] for r in reference["greedy"]]


def test_generate_refuses_a_wrong_process_count_and_bad_flags(checkpoint, tmp_path):
    result = gigatron("generate", "--load", str(checkpoint), "--prompt", "x", "--top-p", "1.5",
                      check=False, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "top_p must be in [0, 1]" in result.stderr
    missing = gigatron("generate", "--load", str(tmp_path), "--prompt", "x", check=False,
                       timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "no checkpoint there" in missing.stderr


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_serving_gives_the_same_tokens(
    checkpoint, reference, tmp_path, tp, pp
):
    """Rank 0 serves HTTP, the other rank follows; concurrent requests batch together."""
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from inference_helpers import start_server, stop_server

    split = tmp_path / f"serve_tp{tp}pp{pp}"
    convert_checkpoint(checkpoint, split, tp, pp)
    process, url = start_server(split, "--max-batch-size", "2", nproc=tp * pp)
    try:

        def ask(prompt):
            body = {"prompts": [prompt], "tokens_to_generate": 10, "top_k": 1,
                    "stop_token": -1}  # fmt: skip
            return requests.put(url + "/api", json=body, timeout=120).json()["tokens"][0]

        with ThreadPoolExecutor(3) as pool:
            tokens = list(pool.map(ask, PROMPTS))
    finally:
        output = stop_server(process)
    expected = [r["prompt_tokens"] + r["tokens"] for r in reference["greedy"]]
    assert tokens == expected, output
