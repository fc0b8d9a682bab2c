"""Generation on CPU: gigatron's engine vs Hugging Face `generate`, same weights, side by side.

Measures (greedy, every stream generates exactly --new-tokens tokens):
- one stream: tokens/s of one prompt;
- 8 concurrent streams: 8 requests arriving together. gigatron: submitted to one engine with
  8 cache slots (continuous batching). Hugging Face has no request scheduler: its figures are
  8 `generate` calls one after another (what a plain server loop does), and, as the best case,
  one left-padded batch of all 8 (possible only when all requests are known in advance);
- time to first token of one prompt (prefill + the first token).
Outputs are checked to be the same tokens. Ratios are gigatron / Hugging Face (higher is better
for tokens/s, lower for time to first token).

    python benchmarks/bench_inference.py [--layers 6 --hidden 384 --new-tokens 64 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gigatron.config.root import GigatronConfig
from gigatron.families.hf_mapping import gpt2_to_gigatron, model_config_from_hf
from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext


def build_pair(args):
    torch.manual_seed(0)
    hf_config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.context, n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf_model = GPT2LMHeadModel(hf_config).eval()
    values = model_config_from_hf(hf_config)
    vocab = values.pop("vocab_size")
    cfg = GigatronConfig()
    for key, value in values.items():
        setattr(cfg.model, key, value)
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=vocab)
    state = gpt2_to_gigatron(hf_model.state_dict(), args.layers, args.heads, model.vocab_size)
    model.load_state_dict(state)
    return model.eval(), hf_model


def engine(model, args, slots):
    runner = ModelRunner([model], ParallelContext.single(), args.vocab, slots, args.context)
    return InferenceEngine(runner)


def paired(ours, theirs, repeats):
    """Median seconds of each, runs alternating (the machine's load drifts), and last results."""
    times: tuple[list[float], list[float]] = ([], [])
    results = [None, None]
    for _ in range(repeats):
        for index, fn in enumerate((ours, theirs)):
            start = time.perf_counter()
            results[index] = fn()
            times[index].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1]), results


@torch.inference_mode()
def hf_generate(hf_model, prompts, new_tokens):
    """Left-padded batch (one prompt: no padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = hf_model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return [row[width:].tolist() for row in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, hf_model = build_pair(args)
    gen = torch.Generator().manual_seed(1)
    # prompts of different lengths around --prompt-tokens
    prompts = [
        torch.randint(0, args.vocab, (args.prompt_tokens - 4 + 2 * i % 9,), generator=gen).tolist()
        for i in range(args.streams)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    n, r = args.new_tokens, args.repeats

    # one stream
    one = engine(model, args, 1)
    g1, h1, (out_g, out_h) = paired(
        lambda: one.generate(prompts[:1], params), lambda: hf_generate(hf_model, prompts[:1], n), r
    )
    assert out_g[0].output_ids == out_h[0], "one stream: different tokens"

    # concurrent streams
    many = engine(model, args, args.streams)
    gs, hs_seq, (out_gs, out_seq) = paired(
        lambda: many.generate(prompts, params),
        lambda: [hf_generate(hf_model, [p], n)[0] for p in prompts],
        r,
    )
    gs2, hs_batch, _ = paired(
        lambda: many.generate(prompts, params), lambda: hf_generate(hf_model, prompts, n), r
    )
    assert [c.output_ids for c in out_gs] == out_seq, "concurrent streams: different tokens"

    # time to first token
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gt, ht, _ = paired(
        lambda: one.generate(prompts[:1], first),
        lambda: hf_generate(hf_model, prompts[:1], 1),
        r * 3,
    )

    s = args.streams
    rows = [
        ("one stream, tokens/s", n / g1, n / h1, "HF generate"),
        (f"{s} concurrent streams, tokens/s", s * n / gs, s * n / hs_seq,
         f"HF generate, {s} requests one after another"),
        (f"{s} concurrent streams, tokens/s", s * n / gs2, s * n / hs_batch,
         f"HF generate, one left-padded batch of {s}"),
        ("time to first token, ms", gt * 1e3, ht * 1e3, "HF generate, max_new_tokens=1"),
    ]  # fmt: skip
    print(
        f"model: GPT-2 shape, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; "
        f"prompts ~{args.prompt_tokens} tokens, {n} new tokens, greedy; "
        f"torch threads {args.threads}; median of {r}, runs alternating"
    )
    print("| measure | gigatron | reference | reference is | ratio |")
    print("|---|---|---|---|---|")
    for name, ours, theirs, what in rows:
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {what} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
