"""`gigatron serve --speculative-draft-load`: a draft model's speculation behind Megatron's
PUT /api and the OpenAI endpoints (streamed too) gives the engine's greedy tokens without
speculation, several requests at once; /health counts the drafts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import requests
from inference_helpers import (
    MODEL_FLAGS,
    engine_from_checkpoint,
    save_tiny_checkpoint,
    start_server,
    stop_server,
)

from gigatron.checkpoint.formats import save_checkpoint
from gigatron.data.tokenizers import build_tokenizer
from gigatron.inference import SamplingParams
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config

TIMEOUT = 60
PROMPTS = ["The capital of France", "Once upon a time there", "def main():", "1 2 3 4"]


def _save_draft(directory) -> None:
    """A one-layer GPT with the target's tokenizer and other weights (seed 6)."""
    flags = [*MODEL_FLAGS]
    flags[flags.index("--num-layers") + 1] = "1"
    flags[flags.index("--seed") + 1] = "6"
    cfg = parse_pretrain_config(flags, world_size=1)
    pctx = ParallelContext.single()
    chunks = build_model(cfg, pctx, vocab_size=build_tokenizer(cfg.tokenizer).vocab_size)
    save_checkpoint(directory, 1, chunks, None, None, pctx, cfg, extra={"gigatron_family": "gpt"})


def test_serve_speculates_with_a_draft_model(tmp_path):
    save_tiny_checkpoint(tmp_path / "target")
    _save_draft(tmp_path / "draft")
    engine, tokenizer = engine_from_checkpoint(tmp_path / "target")
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    completions = engine.generate([tokenizer.tokenize(p) for p in PROMPTS], greedy)
    expected = [c.text for c in completions]
    process, url = start_server(
        tmp_path / "target", "--max-batch-size", "4", "--num-speculative-tokens", "3",
        "--speculative-draft-load", str(tmp_path / "draft"),
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT)

        def complete(prompt: str) -> str:
            result = client.completions.create(
                model="m", prompt=prompt, max_tokens=10, temperature=0
            )
            return result.choices[0].text

        with ThreadPoolExecutor(4) as pool:  # four requests decode together
            assert list(pool.map(complete, PROMPTS)) == expected
        body = {"prompts": PROMPTS[:2], "tokens_to_generate": 10, "top_k": 1}
        answer = requests.put(url + "/api", json=body, timeout=TIMEOUT).json()
        assert [t[len(p) :] for t, p in zip(answer["text"], PROMPTS)] == expected[:2]
        stream = client.completions.create(
            model="m", prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[2]
        assert chunks[-1].usage.completion_tokens == len(completions[2].output_ids)
        health = requests.get(url + "/health", timeout=TIMEOUT).json()
        assert health["speculative_drafted"] > 0, health
        assert 0 <= health["speculative_accepted"] <= health["speculative_drafted"], health
    finally:
        output = stop_server(process)
    assert "Traceback" not in output, output
