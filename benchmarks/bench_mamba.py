"""CPU throughput of the Mamba-2 scan and layer against the naive recurrence and an attention
layer of the same width, at several sequence lengths.

    python benchmarks/bench_mamba.py [--hidden 256 --seqs 512 2048 8192 --rounds 3 --threads 1]

Rows per sequence length (batch 1, fp32):
- scan: `ssd_chunked_scan` (the mixer's chunk, 64) and `ssd_sequential_scan` (one step at a
  time), forward, on the same inputs (H = 2 * hidden / 64 heads of 64 channels, 1 group,
  state 128);
- layer: gigatron's Mamba layer (norm + mixer) and an attention layer (norm + self-attention,
  hidden / 64 heads of 64, causal SDPA), forward and forward + backward.
Each candidate's best CPU time (process time) and best wall time over `rounds` rounds; rounds
alternate between the candidates so background load affects them alike. On a shared machine the
CPU time is the steadier figure (one thread by default, so that it counts work, not waiting
threads). Prints a markdown table: tokens/s by CPU time, and each row's ratio to the attention
layer (for the scans: to the recurrence) at the same length, by CPU and by wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.config.root import GigatronConfig
from gigatron.models.mamba import CHUNK_SIZE, MambaLayer, MambaSpec
from gigatron.models.ssd import ssd_chunked_scan, ssd_sequential_scan
from gigatron.models.transformer import Norm, SelfAttention
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import initialize_parameters


def config(hidden: int) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = 1, hidden, hidden // 64
    m.normalization, m.add_bias_linear = "RMSNorm", False
    m.attention_dropout = m.hidden_dropout = 0.0
    m.mamba_state_dim, m.mamba_head_dim, m.mamba_num_groups = 128, 64, 1
    return cfg


class AttentionLayer(nn.Module):
    """A hybrid stack's attention layer: x + attention(norm(x))."""

    def __init__(self, spec: TransformerConfig, pctx: ParallelContext) -> None:
        super().__init__()
        self.norm = Norm(spec, pctx)
        self.attention = SelfAttention(spec, pctx, 1, ModelParallelRNG(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.norm(x))


def build_layers(hidden: int) -> tuple[nn.Module, nn.Module]:
    cfg = config(hidden)
    pctx = ParallelContext.single()
    spec = TransformerConfig.from_config(cfg)
    mamba = MambaLayer(spec, MambaSpec.from_config(cfg), pctx, 1, ModelParallelRNG(0))
    attention = AttentionLayer(spec, pctx)
    for module in (mamba, attention):
        initialize_parameters(module, 1234, 0, 1)
    return mamba, attention


def scan_inputs(seq: int, heads: int, state: int = 128, head_dim: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, heads, head_dim, generator=g)
    dt = F.softplus(torch.randn(1, seq, heads, generator=g) - 3)
    A = -torch.rand(heads, generator=g) * 8 - 1
    B = torch.randn(1, seq, 1, state, generator=g)
    C = torch.randn(1, seq, 1, state, generator=g)
    return x, dt, A, B, C


def best_times(
    candidates: dict[str, Callable[[], object]], rounds: int
) -> dict[str, tuple[float, float]]:
    """Best (CPU, wall) seconds of each candidate over alternating rounds, after a warm-up."""
    best = {name: (float("inf"), float("inf")) for name in candidates}
    for fn in candidates.values():
        fn()
    for _ in range(rounds):
        for name, fn in candidates.items():
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            best[name] = (min(best[name][0], cpu), min(best[name][1], wall))
    return best


def forward_backward(layer: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    return run


def measure(hidden: int, seq: int, rounds: int) -> list[tuple[str, float, float, float]]:
    mamba, attention = build_layers(hidden)
    x = torch.randn(seq, 1, hidden, generator=torch.Generator().manual_seed(1))
    inputs = scan_inputs(seq, 2 * hidden // 64)
    with torch.no_grad():
        scans = best_times(
            {
                "chunked scan (fwd)": lambda: ssd_chunked_scan(*inputs, CHUNK_SIZE),
                "naive recurrence (fwd)": lambda: ssd_sequential_scan(*inputs),
            },
            rounds,
        )
        forward = best_times(
            {"Mamba layer (fwd)": lambda: mamba(x), "attention layer (fwd)": lambda: attention(x)},
            rounds,
        )
    both = best_times(
        {
            "Mamba layer (fwd+bwd)": forward_backward(mamba, x),
            "attention layer (fwd+bwd)": forward_backward(attention, x),
        },
        rounds,
    )
    rows = []
    for group, reference in (
        (scans, "naive recurrence (fwd)"),
        (forward, "attention layer (fwd)"),
        (both, "attention layer (fwd+bwd)"),
    ):
        ref_cpu, ref_wall = group[reference]
        for name, (cpu, wall) in group.items():
            rows.append((name, seq / cpu, ref_cpu / cpu, ref_wall / wall))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, hidden {args.hidden}, batch 1, fp32")
    print("| seq | what | tokens/s (CPU time) | ratio (CPU time) | ratio (wall) |")
    print("|---|---|---|---|---|")
    for seq in args.seqs:
        for name, tokens_per_s, cpu_ratio, wall_ratio in measure(args.hidden, seq, args.rounds):
            print(
                f"| {seq} | {name} | {tokens_per_s:,.0f} | {cpu_ratio:.2f} | {wall_ratio:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
