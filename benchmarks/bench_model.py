"""Forward + backward throughput of gigatron's GPT (tp = 1) against a plain PyTorch GPT of the
same shape (no parallel machinery) and Hugging Face's GPT2LMHeadModel.

    python benchmarks/bench_model.py [--layers 6 --hidden 512 --seq 512 --batch 4 --steps 3]

Prints a markdown table: tokens/s of each and its ratio to the plain model. All three run fp32
on the CPU with dropout off, GeLU (tanh), learned positions, tied embeddings; timed rounds
alternate between the models so background load affects them alike.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


class PlainBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """The baseline: a textbook GPT-2 in [batch, seq, hidden] layout, SDPA attention."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(PlainBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def build_all(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from gigatron.config.root import GigatronConfig
    from gigatron.families.gpt import token_losses
    from gigatron.models import build_model
    from gigatron.parallel.context import ParallelContext

    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, args.heads
    m.seq_length, m.padded_vocab_size = args.seq, args.vocab
    m.attention_dropout = m.hidden_dropout = 0.0
    m.openai_gelu = True
    (gigatron_model,) = build_model(cfg, ParallelContext.single())
    hf_model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=args.vocab,
            n_positions=args.seq,
            n_embd=args.hidden,
            n_layer=args.layers,
            n_head=args.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    plain = PlainGPT(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    positions = torch.arange(args.seq).expand(args.batch, args.seq)

    def step_gigatron():
        token_losses(
            gigatron_model(tokens, positions), tokens, ParallelContext.single()
        ).mean().backward()

    def step_plain():
        logits = plain(tokens, positions)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()

    def step_hf():
        logits = hf_model(tokens).logits
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()

    models = {
        "gigatron GPT (tp=1)": gigatron_model,
        "plain PyTorch GPT": plain,
        "HF GPT2LMHeadModel": hf_model,
    }
    for model in models.values():
        model.train()
    steps = dict(zip(models, (step_gigatron, step_plain, step_hf)))
    return models, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds per model")
    args = parser.parse_args()
    torch.manual_seed(0)
    models, steps = build_all(args)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    for step in steps.values():  # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            for model in models.values():
                model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    best = {name: tokens / min(t) for name, t in times.items()}
    baseline = best["plain PyTorch GPT"]
    print(
        f"fwd+bwd, fp32, CPU ({torch.get_num_threads()} threads), {args.layers} layers, hidden "
        f"{args.hidden}, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; best of "
        f"{args.steps}\n"
    )
    print("| model | parameters | tokens/s | ratio to plain |")
    print("|---|---|---|---|")
    for name in steps:
        print(
            f"| {name} | {params[name] / 1e6:.2f}M | {best[name]:.0f} | {best[name] / baseline:.2f} |"
        )


if __name__ == "__main__":
    main()
