"""Peak memory of building a GPT's chunks eagerly and with --init-model-with-meta-device, each in
a fresh process (peak resident set size after the build, minus before it).

    python benchmarks/bench_meta_init.py [--layers 8 --hidden 1024]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def build(layers: int, hidden: int, meta: bool) -> None:
    from gigatron.config.root import parse_config  # why: imported in the measured child only
    from gigatron.families import get_family
    from gigatron.parallel.context import ParallelContext

    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
             "16", "--seq-length", "128", "--max-position-embeddings", "128",
             "--vocab-size", "32000"]  # fmt: skip
    cfg = parse_config([*flags, *(["--init-model-with-meta-device"] if meta else [])])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), 32000)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} {(after - before) / 1024:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--child", choices=["eager", "meta"])
    args = parser.parse_args()
    if args.child:
        build(args.layers, args.hidden, args.child == "meta")
        return
    print("| build | parameters | fp32 parameter MiB | peak RSS growth MiB |")
    print("|---|---|---|---|")
    for mode in ("eager", "meta"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--layers", str(args.layers),
             "--hidden", str(args.hidden)],
            check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        params, grown = int(out[0]), float(out[1])
        print(f"| {mode} | {params} | {params * 4 / 2**20:.1f} | {grown:.1f} |")


if __name__ == "__main__":
    main()
