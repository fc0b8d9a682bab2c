"""`gigatron generate` from a saved checkpoint: the same tokens as the engine in-process, and the
same tokens at tensor-parallel 2 and pipeline-parallel 2 (torchrun) as at 1, with the static and
the dynamic engine (paged KV cache, chunked prefill, prefix caching, a pool small enough to
preempt). The generate runs go in one launch per process count (`generated`,
helpers.gigatron_runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_helpers import engine_from_checkpoint, save_tiny_checkpoint

from gigatron.checkpoint.convert import convert_checkpoint
from gigatron.inference import SamplingParams
from helpers import gigatron, gigatron_runs, records

PROMPTS = ["The quick brown fox", "Hello", "In 1999, the city of Paris had"]


def generate_command(load: Path, output: Path, *flags: str) -> list[str]:
    prompt_flags = [item for prompt in PROMPTS for item in ("--prompt", prompt)]
    return ["generate", "--load", str(load), "--device", "cpu", *prompt_flags,
            "--output", str(output), *flags]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("generate") / "ckpt"
    save_tiny_checkpoint(directory)
    return directory


GREEDY = ["--greedy", "--max-tokens", "10", "--max-batch-size", "2", "--ignore-eos"]
SAMPLED = ["--temperature", "0.9", "--top-k", "20", "--sampling-seed", "3", "--max-tokens", "10",
           "--ignore-eos", "--logprobs"]  # fmt: skip


# The dynamic engine: blocks of 4 positions, 6 tokens a step, 8 KB of blocks per rank (6 blocks
# at tp 1: 2 layers x keys and values x 64 channels x float32 x 4 positions; 12 at tp 2 or pp 2).
DYNAMIC = ["--inference-dynamic-batching", "--inference-dynamic-batching-block-size", "4",
           "--inference-dynamic-batching-max-tokens", "6", "--enable-chunked-prefill",
           "--inference-dynamic-batching-prefix-caching",
           "--inference-dynamic-batching-buffer-size-gb", str(6 * 4096 / 2**30)]  # fmt: skip
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


@pytest.fixture(scope="module")
def generated(checkpoint) -> dict[str, list[dict]]:
    """The records of every `gigatron generate` run of this file, by name (`<sampling>` at one
    process, `<layout>-<sampling>` on a converted checkpoint, `dist<n>` from a torch_dist
    checkpoint at n processes), in one launch per process count."""
    root = checkpoint.parent
    save_tiny_checkpoint(root / "dist", ckpt_format="torch_dist")
    sampling = {"greedy": GREEDY, "sampled": SAMPLED, "dynamic-greedy": GREEDY + DYNAMIC,
                "dynamic-sampled": SAMPLED + DYNAMIC}  # fmt: skip
    runs = {name: (1, generate_command(checkpoint, root / f"{name}.jsonl", *flags))
            for name, flags in sampling.items()}  # fmt: skip
    for layout, (tp, pp) in LAYOUTS.items():
        convert_checkpoint(checkpoint, root / layout, tp, pp)
        for name, flags in sampling.items():
            out = root / f"{layout}-{name}.jsonl"
            runs[f"{layout}-{name}"] = (tp * pp, generate_command(root / layout, out, *flags))
    # A torch_dist checkpoint loads at tensor-parallel = the process count: no conversion.
    for nproc in (1, 2):
        out = root / f"dist{nproc}.jsonl"
        runs[f"dist{nproc}"] = (nproc, generate_command(root / "dist", out, *GREEDY))
    gigatron_runs(root, runs)
    return {name: records(root / f"{name}.jsonl") for name in runs}


@pytest.fixture(scope="module")
def reference(generated) -> dict[str, list[dict]]:
    return {name: generated[name] for name in ("greedy", "sampled")}


def test_generate_matches_the_engine_in_process(checkpoint, generated):
    records = generated["greedy"]
    engine, tokenizer = engine_from_checkpoint(checkpoint)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate([tokenizer.tokenize(p) for p in PROMPTS], params)
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["tokens"] for r in records] == [c.output_ids for c in expected]
    assert [r["text"] for r in records] == [tokenizer.detokenize(c.output_ids) for c in expected]
    assert all(len(r["tokens"]) == 10 and r["finish_reason"] == "length" for r in records)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_and_pipeline_parallel_give_the_same_tokens(generated, reference, layout):
    for name in ("greedy", "sampled", "dynamic-greedy", "dynamic-sampled"):
        records = generated[f"{layout}-{name}"]
        expected = reference[name.removeprefix("dynamic-")]
        assert [r["tokens"] for r in records] == [r["tokens"] for r in expected]
        if name.endswith("sampled"):
            for got, want in zip(records, expected):
                torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-4, rtol=0)


def test_the_dynamic_engine_generates_the_static_engine_tokens(generated, reference):
    for name in ("greedy", "sampled"):
        records = generated[f"dynamic-{name}"]
        assert [r["tokens"] for r in records] == [r["tokens"] for r in reference[name]]


def test_torch_dist_checkpoint_generates_the_same_tokens_at_any_tp(generated, reference):
    for nproc in (1, 2):
        records = generated[f"dist{nproc}"]
        assert [r["tokens"] for r in records] == [r["tokens"] for r in reference["greedy"]]


def test_generate_refuses_a_wrong_process_count_and_bad_flags(checkpoint, tmp_path):
    result = gigatron("generate", "--load", str(checkpoint), "--prompt", "x", "--top-p", "1.5",
                      check=False, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "top_p must be in [0, 1]" in result.stderr
    missing = gigatron("generate", "--load", str(tmp_path), "--prompt", "x", check=False,
                       timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "no checkpoint there" in missing.stderr
    lone = gigatron("generate", "--load", str(checkpoint), "--prompt", "x",
                    "--enable-chunked-prefill", check=False, timeout=60)  # fmt: skip
    assert lone.returncode == 2
    assert "--enable-chunked-prefill: a flag of the dynamic engine; add " in lone.stderr


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
