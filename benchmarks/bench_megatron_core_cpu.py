"""A full training step on CPU: `gigatron pretrain gpt` against Megatron-Core, side by side.

Same shape for both (default: 6 layers, hidden 512, 8 heads, seq 512, vocab 50304, micro-batch
4, fp32, dropout 0.1, tied embeddings, learned absolute positions, LayerNorm, GeLU):
  gigatron   what `gigatron pretrain gpt --mock-data ...` builds (the same `pretrain` call:
             mock dataset and loader, model in DistributedDataParallel buffers, optimizer with
             grad-norm clipping, lr schedule), stepped by the loop's own `train_step` plus the
             lr-schedule step;
  megatron   Megatron-Core's GPTModel with the local (pure PyTorch) layer spec, the causal mask
             Megatron's data loader makes, the loss from the model's labels path, and
             torch.optim.AdamW, in a plain loop (forward, masked mean, backward, step, zero).
Megatron-Core needs a process group and model-parallel state even at size 1 (Gloo here), and two
CUDA-only spots are bypassed for the CPU: its attention score buffer is allocated on the CPU and
its RNG tracker is the no-op one (dropout then draws from torch's default generator).

All live in one process and their steps alternate (in order on even steps, in reverse order on
odd ones), so that a machine shared with other jobs slows all alike. The first --warmup steps
of each are dropped; prints the median tokens/s (wall) and CPU seconds (process time) per step
of each and their ratios. `--profile` instead profiles --repeats alternating steps of each
(after warm-up) and prints, per operator, the smallest self CPU time of each side by side.

`--torch-compile` adds a third side, gigatron built with `--torch-compile` (each layer compiled by
inductor in its first step, dropped with the warm-up), stepped in turn with the other two;
Megatron-Core's side is its own default in every case.

Megatron-Core is not a dependency of gigatron: install it beside it with
`pip install --no-deps megatron-core==0.16.1` (its pure-PyTorch parts need nothing else), or put
an unpacked wheel first on PYTHONPATH (`PYTHONPATH=/path/to/mcore-site:src`).

    python benchmarks/bench_megatron_core_cpu.py [--steps 8 --warmup 2] [--clip-grad 1.0]
        [--threads 2] [--torch-compile] [--profile [--shapes]] [--reference-cross-entropy]
        [--unfused-adam]
"""

from __future__ import annotations

import argparse
import functools
import operator
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def gigatron_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--mock-data", "--vocab-size", str(min(50257, args.vocab)), "--padded-vocab-size",
        str(args.vocab),
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--micro-batch-size", str(args.batch),
        "--global-batch-size", str(args.batch), "--attention-dropout", str(args.dropout),
        "--hidden-dropout", str(args.dropout), "--lr", "1e-4", "--weight-decay", "0.01",
        "--clip-grad", str(args.clip_grad), "--train-iters", str(args.steps + 1),
        "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1000",
        "--metrics-file", os.path.join(tempfile.gettempdir(), "bench_megatron_core_cpu.jsonl"),
    ]  # fmt: skip


def gigatron_step(run: Any) -> Callable[[], float]:
    """One iteration of gigatron's loop on the built run: train_step, then the lr schedule."""
    from gigatron.training import loop

    def step() -> float:
        result = loop.train_step(run, run.batch_calculator.get())
        run.scheduler.step(increment=run.batch_calculator.get_current_global_batch_size())
        return result.losses["lm_loss"]

    return step


def megatron_step(args: argparse.Namespace) -> Callable[[], float]:
    """Megatron-Core's GPTModel (local spec) with torch.optim.AdamW, one iteration per call."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core import utils as mcore_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)

    def cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
        # Megatron's attention-score buffer, on the CPU instead of the current GPU.
        n = functools.reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < n:
            buffer = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buffer[:n].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = cpu_buffer
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        attention_dropout=args.dropout,
        hidden_dropout=args.dropout,
        init_method_std=0.02,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    b, s = args.batch, args.seq
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (args.steps + 1, b, s + 1), generator=generator)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    loss_mask = torch.ones(b, s)
    count = iter(range(args.steps + 1))

    def step() -> float:
        i = next(count)
        losses = model(data[i, :, :-1], position_ids, causal, labels=data[i, :, 1:])
        loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure(steps: dict[str, Callable[[], float]], args: argparse.Namespace) -> dict[str, list]:
    names = list(steps)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(args.steps):
        for name in names if i % 2 == 0 else names[::-1]:
            start, cpu = time.perf_counter(), time.process_time()
            loss = steps[name]()
            times[name].append((time.perf_counter() - start, time.process_time() - cpu))
            wall = times[name][-1][0]
            print(f"step {i} {name}: {wall:.2f} s, loss {loss:.4f}", file=sys.stderr)
    return times


def profile(steps: dict[str, Callable[[], float]], args: argparse.Namespace) -> None:
    """Profile alternating steps of each (--repeats rounds after --warmup); per operator (and
    input shapes with --shapes) the smallest self CPU time over the rounds, side by side."""
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    best: dict[str, dict[str, tuple[float, int]]] = {name: {} for name in steps}
    totals: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=args.shapes
            ) as prof:
                step()
            events = prof.key_averages(group_by_input_shape=args.shapes)
            totals[name].append(sum(e.self_cpu_time_total for e in events) / 1e3)
            for event in events:
                key = event.key + (f" {event.input_shapes}" if args.shapes else "")
                ms = event.self_cpu_time_total / 1e3
                if key not in best[name] or ms < best[name][key][0]:
                    best[name][key] = (ms, event.count)
    keys = sorted(
        set().union(*(best[n] for n in steps)),
        key=lambda k: -max(best[n].get(k, (0.0, 0))[0] for n in steps),
    )
    print(f"self CPU ms per step, the smallest of {args.repeats} alternating profiled steps")
    print()
    print("| operator | " + " | ".join(f"{n} ms (calls)" for n in steps) + " |")
    print("|---" * (len(steps) + 1) + "|")
    for key in keys[: args.rows]:
        cells = []
        for name in steps:
            ms, count = best[name].get(key, (0.0, 0))
            cells.append(f"{ms:.0f} ({count})" if count else "-")
        print(f"| {key[:90]} | " + " | ".join(cells) + " |")
    each = " | ".join(f"{min(totals[n]):.0f}" for n in steps)
    print(f"| total self CPU (smallest round) | {each} |")


def report(times: dict[str, list], args: argparse.Namespace) -> None:
    tokens = args.batch * args.seq
    kept = {name: values[args.warmup :] for name, values in times.items()}
    wall = {name: statistics.median(w for w, _ in values) for name, values in kept.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in kept.items()}
    print(
        f"shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"micro-batch {args.batch}, vocab {args.vocab}, fp32, dropout {args.dropout}; gigatron "
        f"--clip-grad {args.clip_grad}{' --torch-compile' if args.torch_compile else ''}; "
        f"{args.threads} threads; steps alternate in one process; "
        f"median of steps {args.warmup + 1}..{args.steps}; {time.strftime('%Y-%m-%d')}"
    )
    print()
    print("| run | tokens/s (wall) | s/step (wall, each step) | CPU s/step |")
    print("|---|---|---|---|")
    for name, values in kept.items():
        each = ", ".join(f"{w:.1f}" for w, _ in values)
        print(
            f"| {name} | {tokens / wall[name]:.0f} | {wall[name]:.2f} ({each}) | {cpu[name]:.2f} |"
        )
    print()
    for name in (n for n in kept if n != "megatron"):
        print(
            f"{name} / Megatron-Core tokens/s: wall **{wall['megatron'] / wall[name]:.3f}**, "
            f"by CPU time **{cpu['megatron'] / cpu[name]:.3f}**"
        )
    if "gigatron-compiled" in kept:
        print(
            "gigatron-compiled / gigatron tokens/s: wall "
            f"**{wall['gigatron'] / wall['gigatron-compiled']:.3f}**, by CPU time "
            f"**{cpu['gigatron'] / cpu['gigatron-compiled']:.3f}**"
        )


def ablate(args: argparse.Namespace) -> None:
    """Put back the reference path of a fast path (for the ablation rows)."""
    if args.reference_cross_entropy:
        import torch.nn.functional as F

        from gigatron.parallel import tensor_parallel

        def torch_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, _overwrite=False):
            flat = logits.float().reshape(-1, logits.shape[-1])
            return F.cross_entropy(flat, labels.reshape(-1), reduction="none").view(labels.shape)

        tensor_parallel._CrossEntropy.apply = torch_cross_entropy
    if args.unfused_adam:
        from gigatron.optim import optimizer

        optimizer._fused_adam_supported = lambda groups: False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304, help="padded vocabulary")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--clip-grad", type=float, default=1.0, help="gigatron's --clip-grad")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="profiled rounds")
    parser.add_argument("--rows", type=int, default=30, help="profile rows")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--reference-cross-entropy", action="store_true", help="ablation: torch's cross entropy"
    )
    parser.add_argument("--unfused-adam", action="store_true", help="ablation: for-loop AdamW")
    parser.add_argument("--shapes", action="store_true", help="profile rows per input shape")
    parser.add_argument(
        "--torch-compile", action="store_true", help="gigatron's layers compiled (inductor)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from gigatron.training import pretrain as pretrain_module

    ablate(args)
    runs: dict[str, Any] = {}
    variants = {"gigatron": []}
    if args.torch_compile:
        variants["gigatron-compiled"] = ["--torch-compile"]
    for name, extra in variants.items():
        # pretrain() calls this in place of the training loop, with the run it built.
        pretrain_module.train = functools.partial(runs.__setitem__, name)
        cfg = pretrain_module.parse_pretrain_config(gigatron_flags(args) + extra)
        pretrain_module.pretrain(cfg, family="gpt")
    steps = {name: gigatron_step(run) for name, run in runs.items()}
    steps["megatron"] = megatron_step(args)
    if args.profile:
        profile(steps, args)
    else:
        report(measure(steps, args), args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
