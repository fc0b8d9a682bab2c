"""Speculative decoding with the MTP heads (inference/speculative.py): acceptance rate and
tokens/s against plain greedy decoding, side by side in one process.

A tiny GPT with `--mtp-num-layers 2` is trained for `--steps` steps on a synthetic language
whose next tokens are mostly predictable (each sequence counts up by a stride drawn per sequence,
with a token of noise now and then), so the heads learn something to draft; then the same
prompts are generated greedily without speculation (the static engine, one prompt at a time) and
with K = 1 and 2 drafts, checking that the tokens are identical.

    python benchmarks/bench_speculative.py --steps 300 --prompts 8 --tokens 48
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.inference import SamplingParams
from gigatron.inference.load import build_engine
from gigatron.inference.speculative import MTPSpeculator
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ, DEPTHS = 64, 64, 2


def corpus(batch: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, SEQ + 1] sequences start + stride * i (mod VOCAB), 5% of tokens random."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=generator) < 0.05
    return torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=generator), tokens)


def train(steps: int, layers: int, hidden: int) -> torch.nn.Module:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = layers, hidden, 4, 256
    m.attention_dropout = m.hidden_dropout = 0.0
    m.mtp_num_layers, m.position_embedding_type = DEPTHS, "rope"
    finalize_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        data = corpus(16, generator)
        tokens, labels = data[:, :-1], data[:, 1:]
        logits, depths = model(tokens, None)
        loss = F.cross_entropy(logits[..., :VOCAB].flatten(0, 1), labels.flatten())
        for k, depth_logits in enumerate(depths, start=1):
            loss = loss + F.cross_entropy(
                depth_logits[:, :-k, :VOCAB].flatten(0, 1), labels[:, k:].flatten()
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = train(args.steps, args.layers, args.hidden)
    prompts = corpus(args.prompts, torch.Generator().manual_seed(1))[:, :8].tolist()
    engine = build_engine([model], ParallelContext.single(), max_batch_size=1, vocab_size=VOCAB)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    begin = time.perf_counter()
    plain = [engine.generate([p], params)[0].output_ids for p in prompts]
    base = time.perf_counter() - begin
    total = args.prompts * args.tokens
    print("| decoding | tokens/s | acceptance | rounds per token | vs plain |")
    print("|---|---|---|---|---|")
    print(f"| plain greedy (static engine) | {total / base:.1f} | - | 1.00 | 1.00 |")
    for k in range(1, DEPTHS + 1):
        speculator = MTPSpeculator(model, k, VOCAB)
        begin = time.perf_counter()
        results = [speculator.generate(p, args.tokens) for p in prompts]
        seconds = time.perf_counter() - begin
        assert [r.output_ids for r in results] == plain, "speculative tokens differ"
        drafted = sum(r.drafted for r in results)
        accepted = sum(r.accepted for r in results)
        rounds = sum(r.rounds for r in results)
        print(
            f"| speculative K={k} | {total / seconds:.1f} | {accepted / drafted:.2f} | "
            f"{rounds / total:.2f} | {base / seconds:.2f} |"
        )


if __name__ == "__main__":
    main()
