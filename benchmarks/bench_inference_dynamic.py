"""The dynamic engine (paged KV cache) vs the static engine vs Hugging Face `generate` on CPU,
side by side in one run, same weights, greedy, every stream generating exactly --new-tokens.

For 1, 8 and 32 concurrent streams (requests arriving together): tokens/s of
- gigatron's static engine (one cache slot of --context positions per stream),
- gigatron's dynamic engine (blocks of --block-size positions, chunked prefill, packed steps),
- Hugging Face `generate` one request after another (no request scheduler), and one
  left-padded batch of all of them (its best case: every request known in advance);
and the KV memory each engine admits per request (static: a whole slot; dynamic: the blocks the
request holds at its longest). Runs alternate between the contenders (the machine's load drifts);
medians of --repeats. The script asserts that all of them produce the same tokens.

    python benchmarks/bench_inference_dynamic.py [--layers 4 --hidden 256 --new-tokens 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench_inference import build_pair, hf_generate
from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams
from gigatron.inference.block_pool import blocks_for
from gigatron.inference.load import build_engine
from gigatron.inference.scheduler import DynamicSettings
from gigatron.parallel.context import ParallelContext


def contenders(model, hf_model, args, streams: int) -> dict:
    static = InferenceEngine(
        ModelRunner([model], ParallelContext.single(), args.vocab, streams, args.context)
    )
    dynamic = build_engine(
        [model], ParallelContext.single(), max_batch_size=streams,
        max_sequence_length=args.context, vocab_size=args.vocab,
        dynamic=DynamicSettings(block_size=args.block_size, max_tokens=args.max_tokens,
                                chunked_prefill=True),
    )  # fmt: skip
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def engine_run(engine):
        return lambda prompts: [c.output_ids for c in engine.generate(prompts, params)]

    return (
        {
            "static engine": engine_run(static),
            "dynamic engine": engine_run(dynamic),
            "HF one by one": lambda prompts: [
                hf_generate(hf_model, [p], args.new_tokens)[0] for p in prompts
            ],  # fmt: skip
            "HF one batch": lambda prompts: hf_generate(hf_model, prompts, args.new_tokens),
        },
        static,
        dynamic,
    )


def measure(runs: dict, prompts, repeats: int) -> tuple[dict, dict]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            outputs[name] = run(prompts)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def admitted_bytes(static, dynamic, prompt_length: int, new_tokens: int) -> tuple[int, int]:
    """KV bytes per request: a static slot; the blocks a request of this length holds."""
    slot = static.runner.cache.bytes() // static.max_batch_size
    cache = dynamic.runner.cache
    per_block = cache.bytes() // cache.num_blocks
    return slot, blocks_for(prompt_length + new_tokens, cache.block_size) * per_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("vocab", 8192),
                          ("context", 512), ("new-tokens", 32), ("block-size", 16),
                          ("max-tokens", 512), ("repeats", 2)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, hf_model = build_pair(args)
    rng = random.Random(0)
    print(
        "| streams | contender | tokens/s | ratio to static engine | KV bytes admitted per request |"
    )
    print("|---|---|---|---|---|")
    for streams in (1, 8, 32):
        prompts = [[rng.randrange(args.vocab) for _ in range(rng.randint(24, 40))]
                   for _ in range(streams)]  # fmt: skip
        runs, static, dynamic = contenders(model, hf_model, args, streams)
        seconds, outputs = measure(runs, prompts, args.repeats)
        expected = outputs["static engine"]
        for name, tokens in outputs.items():
            assert [list(t) for t in tokens] == expected, f"{name} differs at {streams} streams"
        slot, blocks = admitted_bytes(static, dynamic, max(map(len, prompts)), args.new_tokens)
        generated = streams * args.new_tokens
        for name, elapsed in seconds.items():
            memory = {"static engine": slot, "dynamic engine": blocks}.get(name, "")
            ratio = seconds["static engine"] / elapsed
            print(f"| {streams} | {name} | {generated / elapsed:.1f} | {ratio:.2f}x | {memory} |")


if __name__ == "__main__":
    main()
