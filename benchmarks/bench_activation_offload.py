"""Fine-grained activation offloading: the activation bytes one training forward keeps for
backward on the device, with each --offload-modules choice, and the measured peak of device
memory when a GPU is present (CPU: the saved-tensor accounting only; the host copies then live
on the same memory).

    python benchmarks/bench_activation_offload.py [--layers 4 --hidden 1024 --seq 1024 --batch 2]
"""

from __future__ import annotations

import argparse

import torch

from gigatron.config.root import parse_config
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

CHOICES = [[], ["attn_norm", "mlp_norm"], ["qkv_linear"], ["core_attn", "attn_proj"],
           ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]]  # fmt: skip


def measure(args, modules: list[str]) -> tuple[int, int, float | None]:
    """(bytes kept on the device for backward, bytes offloaded, device peak MiB or None)."""
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.hidden // 64), "--seq-length", str(args.seq),
             "--max-position-embeddings", str(args.seq), "--vocab-size", "32000", "--swiglu",
             "--position-embedding-type", "rope", "--micro-batch-size", str(args.batch),
             "--min-offloaded-tensor-size", "0"]  # fmt: skip
    if modules:
        flags += ["--fine-grained-activation-offloading", "--offload-modules", *modules]
    cfg = parse_config(flags)
    pctx = ParallelContext.single()
    (model,) = get_family("gpt").build_model(cfg, pctx, 32000)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):  # the outer hooks: what the modules' own (innermost) hooks do not take
        if tensor.untyped_storage().data_ptr() not in params:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    tokens = torch.randint(0, 32000, (args.batch, args.seq), device=pctx.device)
    cuda = pctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, None).float().square().mean()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    loss.backward()
    offloaded = sum(getattr(model, "activation_offload", None).bytes.values()) if modules else 0
    return sum(saved), offloaded, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    total, _, _ = measure(args, [])
    print(
        "| --offload-modules | MiB offloaded | MiB kept on device | kept / none | device peak MiB |"
    )
    print("|---|---|---|---|---|")
    for modules in CHOICES:
        kept, offloaded, peak = measure(args, modules)
        assert kept + offloaded == total  # every saved activation is counted once
        peak_text = "n/a (CPU)" if peak is None else f"{peak:.0f}"
        print(
            f"| {' '.join(modules) or '(none)'} | {offloaded / 2**20:.1f} | {kept / 2**20:.1f} "
            f"| {kept / total:.2f} | {peak_text} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
