"""The parts of a CPU training step where gigatron and Megatron-Core differ, timed alone.

Process CPU seconds (the smallest of --repeats alternating runs, one thread), at the shape of
bench_megatron_core_cpu.py (seq 512, micro-batch 4, vocab 50304, hidden 512, 8 heads):
  cross entropy  forward + backward on [512, 4, 50304] float32 logits: torch's F.cross_entropy
                 (gigatron before issue 17), gigatron's, and Megatron-Core's
                 vocab_parallel_cross_entropy (when megatron-core is installed);
  AdamW          one step over the 44.9M parameters of that GPT (same tensor shapes): torch's
                 for-loop (what torch.optim.AdamW picks on CPU), foreach and fused forms;
  attention      forward + backward of causal attention with dropout 0.1 on [4, 8, 512, 64]:
                 SDPA (gigatron) and baddbmm + masked_fill + softmax + dropout + bmm (the
                 computation of Megatron-Core's local DotProductAttention).

    python benchmarks/bench_step_parts.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gigatron.parallel.tensor_parallel import _CrossEntropy

SEQ, BATCH, VOCAB, HIDDEN, HEADS, LAYERS = 512, 4, 50304, 512, 8, 6


def cpu_seconds(fn: Callable[[], None]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def smallest(cases: dict[str, Callable[[], Callable[[], None]]], repeats: int) -> dict:
    """Each case makes a fresh closure (setup not timed); alternate, keep the smallest."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, make in cases.items():
            seconds = cpu_seconds(make())
            best[name] = min(best.get(name, math.inf), seconds)
    return best


def megatron_cross_entropy() -> Callable | None:
    try:
        import torch.distributed as dist

        warnings.filterwarnings("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError:
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    return vocab_parallel_cross_entropy


def cross_entropy_cases() -> dict[str, Callable]:
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    logits = torch.randn(SEQ, BATCH, VOCAB)

    def case(loss_fn: Callable) -> Callable:
        def make() -> Callable[[], None]:
            leaf = logits.clone().requires_grad_()
            return lambda: loss_fn(leaf).sum().backward()

        return make

    cases = {
        "torch F.cross_entropy": case(
            lambda x: F.cross_entropy(x.view(-1, VOCAB), labels.view(-1), reduction="none")
        ),
        "gigatron": case(lambda x: _CrossEntropy.apply(x, labels)),
    }
    megatron = megatron_cross_entropy()
    if megatron is not None:
        cases["Megatron-Core"] = case(lambda x: megatron(x, labels))
    return cases


def adam_cases() -> dict[str, Callable]:
    h = HIDDEN
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h)] + [(h,)] * 5
    shapes = [(VOCAB, h), (SEQ, h)] + layer * LAYERS + [(h,), (h,)]
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=generator) for s in shapes]

    def case(**kind) -> Callable:
        params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kind)

        def make() -> Callable[[], None]:
            for p, g in zip(params, grads):
                p.grad = g
            return optimizer.step

        make()()  # the first step creates the state
        return make

    return {
        "for-loop": case(foreach=False),
        "foreach": case(foreach=True),
        "fused": case(fused=True),
    }


def attention_cases() -> dict[str, Callable]:
    b, n, s, d = BATCH, HEADS, SEQ, HIDDEN // HEADS
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    def explicit(q, k, v):
        scores = torch.baddbmm(
            torch.empty(b * n, s, s),
            q.reshape(b * n, s, d),
            k.reshape(b * n, s, d).transpose(1, 2),
            beta=0.0,
            alpha=1 / math.sqrt(d),
        ).view(b, n, s, s)
        probs = torch.softmax(scores.masked_fill_(causal, float("-inf")), dim=-1)
        return torch.matmul(F.dropout(probs, 0.1, True), v)

    def case(attention: Callable) -> Callable:
        def make() -> Callable[[], None]:
            q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for _ in range(3))
            return lambda: attention(q, k, v).sum().backward()

        return make

    return {"SDPA (gigatron)": case(sdpa), "explicit (Megatron-Core local)": case(explicit)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"process CPU seconds, one thread, smallest of {args.repeats}; {time.strftime('%F')}")
    print()
    print("| part | implementation | CPU s |")
    print("|---|---|---|")
    for part, cases in (
        ("cross entropy fwd+bwd, 2048 x 50304", cross_entropy_cases()),
        ("AdamW step, 44.9M parameters", adam_cases()),
        ("causal attention + dropout fwd+bwd, one layer", attention_cases()),
    ):
        for name, seconds in smallest(cases, args.repeats).items():
            print(f"| {part} | {name} | {seconds:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
