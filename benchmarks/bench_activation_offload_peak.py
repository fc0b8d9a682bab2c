"""Peak memory of one training forward + backward with and without fine-grained activation
offloading, each setting in a fresh process: the growth of the peak resident set size
(`ru_maxrss`) over the pass, after the model is built. On a CPU-only machine "device" and "host"
are the same memory, so this measures what offloading costs or saves there; on a GPU see
bench_activation_offload.py's device peak.

    python benchmarks/bench_activation_offload_peak.py [--layers 4 --hidden 512 --seq 512]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

CHOICES = ["", "core_attn attn_proj", "attn_norm qkv_linear core_attn attn_proj mlp_norm"]


def run_pass(args, modules: str) -> None:
    import torch  # why: imported in the measured child only

    from gigatron.config.root import parse_config
    from gigatron.families import get_family
    from gigatron.parallel.context import ParallelContext

    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.hidden // 64), "--seq-length", str(args.seq),
             "--max-position-embeddings", str(args.seq), "--vocab-size", "32000", "--swiglu",
             "--position-embedding-type", "rope", "--micro-batch-size", str(args.batch),
             "--min-offloaded-tensor-size", "0"]  # fmt: skip
    if modules:
        flags += ["--fine-grained-activation-offloading", "--offload-modules", *modules.split()]
    (model,) = get_family("gpt").build_model(parse_config(flags), ParallelContext.single(), 32000)
    tokens = torch.randint(0, 32000, (args.batch, args.seq))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model(tokens, None).float().square().mean().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{(after - before) / 1024:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--child", default=None, help="(internal) the --offload-modules to run")
    args = parser.parse_args()
    if args.child is not None:
        run_pass(args, args.child)
        return
    print("| --offload-modules | peak RSS growth over forward + backward, MiB | vs none |")
    print("|---|---|---|")
    base = None
    for modules in CHOICES:
        out = subprocess.run(
            [sys.executable, __file__, "--child", modules, "--layers", str(args.layers),
             "--hidden", str(args.hidden), "--seq", str(args.seq), "--batch", str(args.batch)],
            check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        grown = float(out[-1])
        base = grown if base is None else base
        print(f"| {modules or '(none)'} | {grown:.1f} | {grown / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
