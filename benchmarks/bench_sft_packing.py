"""Benchmark sequence packing for --sft: fill ratio and trained tokens/s, packed vs padded.

The instruction set is built here from real text already in tests/data (see its README for
sources and licences): every RACE question of tests/data/race-sample (instruction: the article,
the question and the four options; response: the letter and text of the answer) and the first
--lambada LAMBADA passages of tests/data/lambada_test.jsonl (instruction: complete the passage
without its last word; response: the last word). So the lengths vary as they do in a real mix:
short completions and long reading-comprehension prompts. Tokenizer: the 1000-piece
SentencePiece model of tests/data (a small vocabulary keeps the output layer from dominating).

Both runs read the same conversations through the SFT dataset class (`--sft`, with and without
`--sft-pack-sequences`) and train one epoch of them on the same GPT (forward, backward; no
optimizer step), micro-batch 1, repeated --repeats times alternating padded and packed; the best
time of each is kept (wall, and this process's CPU time, the steadier figure on a shared
machine). Tokens/s counts the conversations' tokens (padding excluded). Prints a
markdown table.

    python benchmarks/bench_sft_packing.py [--seq-length 1024] [--lambada 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from gigatron.data.sft_dataset import SFTDataset, build_sft_datasets
from gigatron.data.tokenizers import build_tokenizer
from gigatron.families.gpt import forward_step
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def race_pairs() -> list[dict]:
    pairs = []
    for path in sorted((DATA / "race-sample" / "RACE").rglob("*.txt")):
        record = json.loads(path.read_text(encoding="utf-8"))
        for question, options, answer in zip(
            record["questions"], record["options"], record["answers"]
        ):
            letters = "ABCD"
            listed = "\n".join(f"{letter}. {text}" for letter, text in zip(letters, options))
            prompt = (
                f"Read the article and answer.\n\n{record['article']}\n\n{question}\n{listed}\n"
            )
            response = f"{answer}. {options[letters.index(answer)]}"
            pairs.append({"prompt": prompt, "response": response})
    return pairs


def lambada_pairs(count: int) -> list[dict]:
    pairs = []
    with open(DATA / "lambada_test.jsonl", encoding="utf-8") as handle:
        for line, _ in zip(handle, range(count)):
            text = json.loads(line)["text"]
            head, last = text.rsplit(" ", 1)
            pairs.append({"prompt": f"Complete the passage.\n\n{head}", "response": f" {last}"})
    return pairs


def flags(data: Path, seq_length: int, packed: bool) -> list[str]:
    return [
        "--sft", *(["--sft-pack-sequences"] if packed else []), "--data-path", str(data),
        "--split", "100,0,0", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(DATA / "spm-botchan-unigram-1000.model"),
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--num-workers", "0",
    ]  # fmt: skip


def train_dataset(cfg, tokenizer) -> SFTDataset:
    dataset, _, _ = build_sft_datasets(cfg, tokenizer, (None, None, None))
    return dataset


def epoch_seconds(model, dataset: SFTDataset) -> tuple[float, float]:
    """Forward and backward over every sample of one pass, micro-batch 1: (wall seconds, CPU
    seconds of this process, steadier than the wall time on a shared machine)."""
    pctx = ParallelContext.single()
    start, cpu = time.perf_counter(), time.process_time()
    for index in range(len(dataset)):
        batch = {k: torch.from_numpy(v)[None] for k, v in dataset[index].items()}
        output, loss_fn = forward_step(pctx, iter([batch]), model)
        loss_sum, tokens, _ = loss_fn(output)
        (loss_sum / tokens.clamp(min=1)).backward()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--lambada", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "instructions.jsonl"
        rows = race_pairs() + lambada_pairs(args.lambada)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        runs = {}
        for packed in (False, True):
            cfg = parse_pretrain_config(flags(data, args.seq_length, packed), world_size=1)
            tokenizer = build_tokenizer(cfg.tokenizer)
            runs[packed] = (cfg, train_dataset(cfg, tokenizer))
        (model,) = build_model(runs[False][0], ParallelContext.single(), tokenizer.vocab_size)
        best = {False: (float("inf"),) * 2, True: (float("inf"),) * 2}
        for _ in range(args.repeats):
            for packed in (False, True):
                wall, cpu = epoch_seconds(model, runs[packed][1])
                best[packed] = (min(best[packed][0], wall), min(best[packed][1], cpu))
                print(
                    f"{'packed' if packed else 'padded'}: {wall:.1f} s, cpu {cpu:.1f} s",
                    file=sys.stderr,
                )
    report(rows, runs, best, args.seq_length)


def report(rows, runs, best, seq_length: int) -> None:
    stats = runs[True][1].packing
    lengths = sorted(len(c.tokens) for c in runs[True][1].dataset.conversations)
    print(
        f"{len(rows)} conversations, tokens per conversation: min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}; seq length {seq_length}\n"
    )
    print(
        "| run | samples | fill ratio | epoch wall s | epoch CPU s | tokens/CPU s | speed-up (CPU) |"
    )
    print("|---|---|---|---|---|---|---|")
    for packed, name in ((False, "padded (one per sample)"), (True, "packed (FFD)")):
        samples = len(runs[packed][1])
        fill = stats.tokens / (samples * seq_length)
        wall, cpu = best[packed]
        print(
            f"| {name} | {samples} | {100 * fill:.1f}% | {wall:.1f} | {cpu:.1f} | "
            f"{stats.tokens / cpu:.0f} | {best[False][1] / cpu:.2f}x |"
        )


if __name__ == "__main__":
    main()
