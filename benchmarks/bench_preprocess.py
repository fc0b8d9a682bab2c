"""Benchmark `gigatron preprocess` against Megatron-LM's tools/preprocess_data.py, side by side.

Builds (or reuses) a JSON-lines English corpus of at least --size-mb MB under /tmp from the
WikiText-2 and LAMBADA files in tests/data, then runs, in alternating rounds on the same cores:
  megatron        Megatron-LM's tools/preprocess_data.py --legacy-tokenizer (its own GPT-2 BPE;
                  the default path downloads `gpt2` from the Hub, impossible offline), from the
                  source tree given by --megatron-lm (e.g. `git archive core_v0.16.1`) with
                  megatron-core installed;
  gigatron (hf)   `gigatron preprocess` with GPT2BPETokenizer forced onto HF `tokenizers`
                  (the reference path);
  gigatron        `gigatron preprocess` as shipped (tiktoken where proven equal);
and optionally (--ceiling) HF `tokenizers` encode_batch over the texts already in memory.
Every run is a whole process (start-up, read, parse, tokenize, write) with --workers workers;
the .bin/.idx files of every run must be byte-identical, or the script fails. Prints a markdown
table of the median wall and CPU seconds per run and their ratios to Megatron's tool.

    python benchmarks/bench_preprocess.py --megatron-lm /tmp/megatron-lm [--size-mb 50]
        [--workers 2] [--repeats 3] [--ceiling]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(
    os.environ.get("GIGATRON_SHARED_DATA", Path(__file__).resolve().parents[1] / "tests" / "data")
)

CEILING_SCRIPT = r"""
import json, os, resource, sys, time
corpus, vocab, merges = sys.argv[1:4]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
tokenizer = Tokenizer(models.BPE.from_file(vocab, merges))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
with open(corpus, encoding="utf-8") as stream:
    texts = [json.loads(line)["text"] for line in stream]
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu_start = usage.ru_utime + usage.ru_stime
start = time.perf_counter()
for i in range(0, len(texts), 2048):
    tokenizer.encode_batch(texts[i : i + 2048], add_special_tokens=False)
elapsed = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu = usage.ru_utime + usage.ru_stime - cpu_start
print(json.dumps({"seconds": elapsed, "cpu": cpu, "rc": 0, "peak_kb": usage.ru_maxrss}))
"""

# Runs a command and reports its wall and CPU time and the largest resident set among it and
# its descendants.
PEAK_WRAPPER = r"""
import json, resource, subprocess, sys, time
start = time.perf_counter()
result = subprocess.run(sys.argv[1:], capture_output=True, text=True)
elapsed = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": elapsed, "cpu": usage.ru_utime + usage.ru_stime,
                  "rc": result.returncode, "stderr": result.stderr[-3000:],
                  "peak_kb": usage.ru_maxrss}))
"""

# Megatron's tool imports megatron.training, whose package __init__ pulls in the whole training
# stack (and triton); register the package without running it, with the accessors the tool's
# imports need, then run the tool unchanged.
MEGATRON_SHIM = r"""
import importlib, runpy, sys, types
root = sys.argv.pop(1)
sys.path.insert(0, root)
package = types.ModuleType("megatron.training")
package.__path__ = [root + "/megatron/training"]
sys.modules["megatron.training"] = package
global_vars = importlib.import_module("megatron.training.global_vars")
for name in dir(global_vars):
    if name.startswith("get_"):
        setattr(package, name, getattr(global_vars, name))
sys.argv[0] = root + "/tools/preprocess_data.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# `gigatron preprocess` with GPT2BPETokenizer held on the reference (HF) path.
GIGATRON_HF = r"""
import sys
import gigatron.data.tokenizers as tokenizers

class ReferenceGPT2(tokenizers.GPT2BPETokenizer):
    def __init__(self, vocab_file, merge_file):
        super().__init__(vocab_file, merge_file, backend="hf")

tokenizers.GPT2BPETokenizer = ReferenceGPT2
from gigatron.data.preprocess import main
sys.exit(main(sys.argv[1:]))
"""


def build_corpus(path: Path, size_mb: float, seed: int = 1234) -> None:
    """Shuffled WikiText-2 paragraphs and LAMBADA passages, repeated to `size_mb` MB."""
    paragraphs = [
        line.strip()
        for line in (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.strip().startswith("=")
    ]
    lambada = [
        json.loads(line)["text"]
        for line in (DATA / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    documents = paragraphs + lambada
    rng = random.Random(seed)
    target = int(size_mb * 1e6)
    written = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as stream:
        while written < target:
            rng.shuffle(documents)
            for text in documents:
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                stream.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break
    tmp.rename(path)


def run_measured(command: list[str], env: dict[str, str]) -> dict:
    wrapped = [sys.executable, "-c", PEAK_WRAPPER, *command]
    output = subprocess.run(wrapped, capture_output=True, text=True, env=env, check=True).stdout
    result = json.loads(output.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise RuntimeError(f"{command[:4]} failed:\n{result['stderr']}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM source tree")
    parser.add_argument("--size-mb", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ceiling", action="store_true", help="also time HF encode_batch")
    parser.add_argument("--corpus", default=None, help="reuse this JSON-lines file")
    args = parser.parse_args()

    corpus = Path(args.corpus or f"/tmp/gigatron_bench_corpus_{int(args.size_mb)}mb.jsonl")
    if not corpus.exists():
        print(f"building {corpus} ...", file=sys.stderr)
        build_corpus(corpus, args.size_mb)
    corpus_bytes = corpus.stat().st_size
    vocab, merges = str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt")
    tokenizer_args = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab]
    tokenizer_args += ["--merge-file", merges]
    common = ["--input", str(corpus), "--workers", str(args.workers), *tokenizer_args]

    env = dict(os.environ)
    runs = {
        "megatron": [sys.executable, "-c", MEGATRON_SHIM, args.megatron_lm, "--legacy-tokenizer"],
        "gigatron (hf)": [sys.executable, "-c", GIGATRON_HF],
        "gigatron": [sys.executable, "-m", "gigatron.cli", "preprocess"],
    }
    results: dict[str, list[dict]] = {name: [] for name in runs}
    if args.ceiling:
        results["ceiling"] = []
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as out_dir:
        for repeat in range(args.repeats):
            for name, command in runs.items():
                prefix = os.path.join(out_dir, name.replace(" ", "_").strip("()") + f"_{repeat}")
                run = run_measured([*command, *common, "--output-prefix", prefix], env)
                results[name].append(run)
                print(f"round {repeat}: {name} {run['seconds']:.2f} s", file=sys.stderr)
            if args.ceiling:
                ceiling_env = dict(env, RAYON_NUM_THREADS=str(args.workers))
                command = [sys.executable, "-c", CEILING_SCRIPT, str(corpus), vocab, merges]
                output = subprocess.run(
                    command, capture_output=True, text=True, env=ceiling_env, check=True
                ).stdout
                results["ceiling"].append(json.loads(output.strip().splitlines()[-1]))
        reference = os.path.join(out_dir, "megatron_0_text_document")
        outputs = sorted(p[: -len(".bin")] for p in os.listdir(out_dir) if p.endswith(".bin"))
        for other in outputs:
            for suffix in (".bin", ".idx"):
                other_path = os.path.join(out_dir, other + suffix)
                if not filecmp.cmp(reference + suffix, other_path, shallow=False):
                    print(f"{other}{suffix} differs from Megatron's", file=sys.stderr)
                    return 1
        size = os.path.getsize(reference + ".bin")

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base_wall, base_cpu = median("megatron", "seconds"), median("megatron", "cpu")
    print(
        f"corpus: {corpus} ({corpus_bytes / 1e6:.1f} MB, {size // 2:,} GPT-2 tokens), "
        f"{args.workers} workers, median of {args.repeats} alternating rounds, "
        f"{time.strftime('%Y-%m-%d')}; {len(outputs)} outputs byte-identical to Megatron's"
    )
    print()
    print(
        "| run | wall s (each round) | CPU s | MB/s | peak RSS (MiB) | wall speed-up over "
        "Megatron | CPU speed-up over Megatron |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in results:
        wall, cpu = median(name, "seconds"), median(name, "cpu")
        rounds = ", ".join(f"{r['seconds']:.1f}" for r in results[name])
        peak = max(r["peak_kb"] for r in results[name]) / 1024
        print(
            f"| {name} | {wall:.2f} ({rounds}) | {cpu:.2f} | {corpus_bytes / wall / 1e6:.2f} | "
            f"{peak:.0f} | {base_wall / wall:.2f} | {base_cpu / cpu:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
