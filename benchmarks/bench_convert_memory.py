"""Peak memory of `gigatron convert` against the size of the model it converts (streaming claim).

Builds a random-init Llama-shaped Hugging Face folder of a few hundred MB (nothing downloaded),
then runs, each in its own process: a baseline (the same command on a 2-layer model of the same
width: interpreter, torch, transformers and one layer's tensors), hf -> gigatron at tp = 1 and at
tp = 2 / pp = 2, and gigatron -> hf. The parent samples /proc/<pid>/status every 5 ms: RssAnon
(memory the process itself holds) and VmHWM (peak resident set, which also counts pages of the
memory-mapped files it reads and writes; the kernel can drop those at any time).

    python benchmarks/bench_convert_memory.py [--hidden 768 --layers 12 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _make_folder(folder: Path, hidden: int, layers: int, vocab: int) -> tuple[int, int]:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64 // 3,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return sum(sizes), max(sizes)


def _measure(argv: list[str]) -> dict[str, float]:
    """Run a command; peak RssAnon and VmHWM (MiB) and wall seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_anon = peak_hwm = 0
    status = Path(f"/proc/{process.pid}/status")
    while process.poll() is None:
        try:
            fields = dict(
                line.split(":", 1) for line in status.read_text().splitlines() if ":" in line
            )
            peak_anon = max(peak_anon, int(fields["RssAnon"].split()[0]))
            peak_hwm = max(peak_hwm, int(fields["VmHWM"].split()[0]))
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.005)
    _, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err.decode()}")
    return {
        "anon_mib": peak_anon / 1024,
        "hwm_mib": peak_hwm / 1024,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (default 768)")
    parser.add_argument("--layers", type=int, default=12, help="layers (default 12)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    args = parser.parse_args()
    convert = [sys.executable, "-m", "gigatron.cli", "convert"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_bytes, largest = _make_folder(root / "hf", args.hidden, args.layers, args.vocab)
        _make_folder(root / "hf-small", args.hidden, 2, args.vocab)
        runs = {
            "baseline: hf -> gigatron, 2 layers": [
                *convert, "--from", "hf", "--to", "gigatron", "--load", str(root / "hf-small"),
                "--save", str(root / "small")],
            "hf -> gigatron, tp 1": [
                *convert, "--from", "hf", "--to", "gigatron", "--load", str(root / "hf"),
                "--save", str(root / "g1")],
            "hf -> gigatron, tp 2 pp 2": [
                *convert, "--from", "hf", "--to", "gigatron", "--load", str(root / "hf"),
                "--save", str(root / "g22"), "--target-tensor-parallel-size", "2",
                "--target-pipeline-parallel-size", "2"],
            "gigatron (tp 2 pp 2) -> hf": [
                *convert, "--from", "gigatron", "--to", "hf", "--load", str(root / "g22"),
                "--save", str(root / "back")],
        }  # fmt: skip
        results = {name: _measure(argv) for name, argv in runs.items()}
    mib = 2**20
    print(
        f"model: {model_bytes / mib:.0f} MiB of fp32 weights, largest tensor {largest / mib:.0f} MiB"
    )
    base = results["baseline: hf -> gigatron, 2 layers"]["anon_mib"]
    print("| run | peak RssAnon MiB | above baseline MiB | / model size | VmHWM MiB | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        above = r["anon_mib"] - base
        print(
            f"| {name} | {r['anon_mib']:.0f} | {above:.0f} | {above * mib / model_bytes:.2f} | "
            f"{r['hwm_mib']:.0f} | {r['wall_s']:.1f} |"
        )
    print(json.dumps({"model_mib": model_bytes / mib, "largest_mib": largest / mib, **results}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
