"""A full training step on CPU: `gigatron pretrain gpt` against Megatron-Core, side by side.

Same shape for both (default: 6 layers, hidden 512, 8 heads, seq 512, vocab 50304, micro-batch
4, fp32, dropout 0.1, tied embeddings, learned absolute positions, LayerNorm, GeLU):
  gigatron   the `gigatron pretrain gpt` command with --mock-data (its whole loop: data loader,
             schedule, DDP gradient buffers, loss, grad-norm clipping, optimizer, lr schedule,
             metrics), iteration times read from its metrics.jsonl;
  megatron   Megatron-Core's GPTModel with the local (pure PyTorch) layer spec, a causal mask as
             Megatron's data loader makes one, the loss from the model's labels path, and
             torch.optim.AdamW, in a plain loop (forward, masked mean, backward, step, zero).
Megatron-Core needs a process group and model-parallel state even at size 1 (Gloo here), and two
CUDA-only spots are bypassed for the CPU: its attention score buffer is allocated on the CPU
and its RNG tracker is the no-op one (dropout then draws from torch's default generator).

Rounds alternate between the two; each round runs --iters iterations and drops the first
--warmup. Prints the median tokens/s of each and the ratio gigatron / megatron per round, by
wall time and by process CPU time per step (the steadier one on a shared machine).
`--profile` instead runs one profiled iteration of each (after warm-up) and prints the operators
by self CPU time.

    python benchmarks/bench_megatron_core_cpu.py [--iters 6 --warmup 2 --repeats 3]
        [--clip-grad 1.0] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MEGATRON_SCRIPT = r"""
import functools, json, operator, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist

shape = json.loads(sys.argv[1])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(shape["port"]))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state, tensor_parallel
from megatron.core import utils as mcore_utils
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

parallel_state.initialize_model_parallel(1, 1)


def cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
    # Megatron's attention-score buffer, allocated on the CPU instead of the current GPU.
    n = functools.reduce(operator.mul, tensor_shape, 1)
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < n:
        buffer = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
    return buffer[:n].view(*tensor_shape)


mcore_utils.GlobalMemoryBuffer.get_tensor = cpu_buffer
tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
torch.manual_seed(1234)
S, B, V = shape["seq"], shape["batch"], shape["vocab"]
config = TransformerConfig(
    num_layers=shape["layers"], hidden_size=shape["hidden"],
    num_attention_heads=shape["heads"], attention_dropout=shape["dropout"],
    hidden_dropout=shape["dropout"], init_method_std=0.02, use_cpu_initialization=True,
)
model = GPTModel(
    config, get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S,
    share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute",
)
optimizer = torch.optim.AdamW(
    model.parameters(), lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8
)
generator = torch.Generator().manual_seed(0)
data = torch.randint(0, V, (shape["iters"], B, S + 1), generator=generator)
position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
causal = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
loss_mask = torch.ones(B, S)


def step(i):
    losses = model(data[i, :, :-1], position_ids, causal, labels=data[i, :, 1:])
    loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


times = []
if shape["profile"]:
    for i in range(shape["warmup"]):
        step(i)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(shape["warmup"])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=shape["rows"]))
else:
    for i in range(shape["iters"]):
        start, cpu = time.perf_counter(), time.process_time()
        step(i)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    print(json.dumps({"times": times, "params": sum(p.numel() for p in model.parameters())}))
dist.destroy_process_group()
"""

# `gigatron pretrain gpt` (what its command line runs), with each training step timed (wall and
# process CPU seconds), or with one step after warm-up profiled.
GIGATRON_SCRIPT = r"""
import json, sys, time
import torch
from gigatron.training import loop
from gigatron.training.pretrain import parse_pretrain_config, pretrain

shape = json.loads(sys.argv[1])
original = loop.train_step
times = []


def timed_step(run, num_microbatches):
    if shape["profile"] and len(times) == shape["warmup"]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = original(run, num_microbatches)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=shape["rows"]))
    else:
        start, cpu = time.perf_counter(), time.process_time()
        result = original(run, num_microbatches)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return result


loop.train_step = timed_step
pretrain(parse_pretrain_config(sys.argv[2:]))
if not shape["profile"]:
    print(json.dumps({"times": times}))
"""


def gigatron_flags(args: argparse.Namespace, iters: int, directory: str) -> list[str]:
    return [
        "--mock-data", "--vocab-size", "50257", "--padded-vocab-size", str(args.vocab),
        "--num-layers", str(args.layers),
        "--hidden-size", str(args.hidden), "--num-attention-heads", str(args.heads),
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
        "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
        "--attention-dropout", str(args.dropout), "--hidden-dropout", str(args.dropout),
        "--lr", "1e-4", "--weight-decay", "0.01", "--clip-grad", str(args.clip_grad),
        "--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--metrics-file", os.path.join(directory, "metrics.jsonl"),
    ]  # fmt: skip


def run_gigatron(args: argparse.Namespace, env: dict[str, str], profile: bool = False) -> str:
    with tempfile.TemporaryDirectory(prefix="bench_mcore_") as directory:
        iters = args.warmup + 1 if profile else args.iters
        command = [sys.executable, "-c", GIGATRON_SCRIPT, shape_json(args, profile)]
        command += gigatron_flags(args, iters, directory)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"gigatron run failed:\n{result.stderr[-3000:]}")
    return result.stdout


def shape_json(args: argparse.Namespace, profile: bool) -> str:
    return json.dumps(
        {
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
            "dropout": args.dropout, "iters": args.iters, "warmup": args.warmup,
            "profile": profile, "rows": args.rows, "port": 29500 + os.getpid() % 1000,
        }
    )  # fmt: skip


def run_megatron(args: argparse.Namespace, env: dict[str, str], profile: bool = False) -> str:
    command = [sys.executable, "-c", MEGATRON_SCRIPT, shape_json(args, profile)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"megatron run failed:\n{result.stderr[-3000:]}")
    return result.stdout


def profile(args: argparse.Namespace, env: dict[str, str]) -> None:
    print("## gigatron\n" + run_gigatron(args, env, profile=True))
    print("## megatron-core\n" + run_megatron(args, env, profile=True))


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


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
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30, help="profile rows")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    if args.profile:
        profile(args, env)
        return 0

    tokens = args.batch * args.seq
    rounds: list[dict[str, float]] = []
    for repeat in range(args.repeats):
        measured = {}
        for name, runner in (("gigatron", run_gigatron), ("megatron", run_megatron)):
            times = last_json(runner(args, env))["times"][args.warmup :]
            measured[name] = statistics.median(wall for wall, _ in times)
            measured[name + "_cpu"] = statistics.median(cpu for _, cpu in times)
        rounds.append(measured)
        print(f"round {repeat}: {measured}", file=sys.stderr)
    print(
        f"shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"micro-batch {args.batch}, vocab {args.vocab}, fp32, dropout {args.dropout}, gigatron "
        f"--clip-grad {args.clip_grad}; {args.threads} threads; median of iterations "
        f"{args.warmup + 1}..{args.iters} per round; {time.strftime('%Y-%m-%d')}"
    )
    print()
    print(
        "| round | gigatron tokens/s | Megatron-Core tokens/s | ratio (wall) | gigatron CPU s "
        "| Megatron-Core CPU s | ratio (CPU) |"
    )
    print("|---|---|---|---|---|---|---|")
    wall_ratios, cpu_ratios = [], []
    for i, r in enumerate(rounds):
        wall_ratios.append(r["megatron"] / r["gigatron"])
        cpu_ratios.append(r["megatron_cpu"] / r["gigatron_cpu"])
        print(
            f"| {i} | {tokens / r['gigatron']:.0f} | {tokens / r['megatron']:.0f} | "
            f"{wall_ratios[-1]:.3f} | {r['gigatron_cpu']:.2f} | {r['megatron_cpu']:.2f} | "
            f"{cpu_ratios[-1]:.3f} |"
        )
    print(
        f"| median | | | **{statistics.median(wall_ratios):.3f}** | | | "
        f"**{statistics.median(cpu_ratios):.3f}** |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
