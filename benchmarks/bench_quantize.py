"""Quality and size of `gigatron quantize` on a small GPT trained here on real text.

Trains a GPT (GPT-2 tokenizer) on the first 90% of tests/data's WikiText-2 test file,
detokenized as `gigatron evaluate --task WIKITEXT103` detokenizes what it scores, saves it,
quantizes it (int8 and int4 round-to-nearest, int4 GPTQ and AWQ, SmoothQuant W8A8 and fp8 with
per-channel or per-tensor weight scales, all calibrated on the training text), and reports for
each: WikiText perplexity of the held-out 10% and LAMBADA accuracy on the first --lambada
passages of tests/data's LAMBADA test file (`gigatron evaluate`), and the size of the Hugging
Face export on disk (fp32 `gigatron convert --to hf` against the compressed-tensors folder of
`--hf-save`).

    python benchmarks/bench_quantize.py [--layers 4 --hidden 256 --steps 300 --group-size 64]

A larger model in two steps (train once in the background, then measure):

    python benchmarks/bench_quantize.py --layers 6 --hidden 768 --heads 12 --lr 1e-3 \
        --steps 100000 --train-seconds 1500 --ckpt CKPT --train-only
    python benchmarks/bench_quantize.py --layers 6 --hidden 768 --heads 12 --ckpt CKPT \
        --group-size 128 --calib-size 16 --lambada 50 --eval-lines 60 --only ...
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.hf_convert import gigatron_to_hf
from gigatron.checkpoint.torch_format import save_checkpoint
from gigatron.data.tokenizers import build_tokenizer
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.checkpoint import quantize_checkpoint
from gigatron.quantize.export import export_compressed
from gigatron.tasks.evaluate import evaluate
from gigatron.tasks.wikitext import wikitext_detokenize
from gigatron.training.pretrain import parse_pretrain_config

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def _flags(args: argparse.Namespace) -> list[str]:
    return [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(DATA / "gpt2-vocab.json"),
        "--merge-file", str(DATA / "gpt2-merges.txt"), "--mock-data",
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--micro-batch-size", "1",
        "--global-batch-size", "1", "--position-embedding-type", "rope", "--normalization",
        "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--train-iters", "1", "--lr", str(args.lr), "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5",
    ]  # fmt: skip


def train(args: argparse.Namespace, text: str, save: Path) -> int:
    cfg = parse_pretrain_config(_flags(args), world_size=1)
    tokenizer = build_tokenizer(cfg.tokenizer)
    (chunk,) = build_model(cfg, ParallelContext.single(), vocab_size=tokenizer.vocab_size)
    tokens = torch.tensor(tokenizer.tokenize(text))
    windows = tokens[: len(tokens) // (args.seq + 1) * (args.seq + 1)].view(-1, args.seq + 1)
    optimizer = torch.optim.AdamW(chunk.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    generator = torch.Generator().manual_seed(0)
    chunk.train()
    start = time.perf_counter()
    for step in range(args.steps):
        batch = windows[torch.randint(0, len(windows), (args.batch,), generator=generator)]
        loss = token_losses(chunk(batch[:, :-1], None), batch[:, 1:], ParallelContext.single())
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
        warmup.step()
        elapsed = time.perf_counter() - start
        if step % 10 == 0:
            print(f"step {step}: loss {loss.mean().item():.3f} ({elapsed:.0f} s)", flush=True)
        if args.train_seconds and elapsed > args.train_seconds:
            print(f"stopped after step {step}: --train-seconds {args.train_seconds}", flush=True)
            break
    save_checkpoint(save, 1, [chunk], None, None, ParallelContext.single(), cfg,
                    extra={"gigatron_family": "gpt"})  # fmt: skip
    return sum(p.numel() for p in chunk.parameters())


def _size(folder: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in folder.rglob(f"*{suffix}"))


def _ppl(load: Path, wiki: Path, seq: int) -> float:
    flags = ["--load", str(load), "--device", "cpu", "--task", "WIKITEXT103", "--valid-data",
             str(wiki), "--overlapping-eval", str(seq), "--no-progress-bar"]  # fmt: skip
    return evaluate(flags)["ppl"]


def _lambada(load: Path, data: Path) -> tuple[float, float]:
    """(accuracy, perplexity of the last tokens) on LAMBADA."""
    flags = ["--load", str(load), "--device", "cpu", "--task", "LAMBADA", "--valid-data",
             str(data), "--no-progress-bar"]  # fmt: skip
    result = evaluate(flags)
    return result["accuracy"], result["target_ppl"]


def _runs(args: argparse.Namespace, calib: Path) -> list[tuple[str, str, int | None, Any]]:
    """(label, --method, group size, calibration) of each quantization measured."""
    data = {"data": str(calib), "size": args.calib_size, "seed": 1234}
    group = args.group_size
    runs = [
        ("int8-weight RTN", "int8-weight", group, None),
        ("int8-weight GPTQ", "int8-weight", group, data),
        ("int4-weight RTN", "int4-weight", group, None),
        ("int4-weight GPTQ", "int4-weight", group, data),
        ("int4-awq", "int4-awq", group, data),
        ("int8-smoothquant (W8A8)", "int8-smoothquant", None, data),
        ("fp8-channel (W8A8 fp8)", "fp8-channel", None, data),
        ("fp8-tensor (W8A8 fp8)", "fp8-tensor", None, data),
    ]
    return [run for run in runs if not args.only or run[0] in args.only]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calib-size", type=int, default=32)
    parser.add_argument("--lambada", type=int, default=300, help="LAMBADA passages scored")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--train-seconds", type=float, default=0, help="stop training after")
    parser.add_argument("--ckpt", type=Path, help="keep the trained model here; reused if there")
    parser.add_argument("--train-only", action="store_true", help="stop after training")
    parser.add_argument("--eval-lines", type=int, default=0, help="lines scored (0: all)")
    parser.add_argument(
        "--eval-text", choices=["heldout", "train"], default="heldout",
        help="score the held-out 10%% (default) or the start of the training text: a model "
        "that has memorised its small training text shows quantization's damage there",
    )  # fmt: skip
    parser.add_argument("--only", nargs="*", help="labels of the methods to run (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines(True)
    cut = len(lines) * 9 // 10
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wiki = root / "heldout.tokens"
        heldout = (lines[cut:] if args.eval_text == "heldout" else lines[:cut])[
            : args.eval_lines or None
        ]
        wiki.write_text("".join(heldout), encoding="utf-8")
        calib = root / "calib.jsonl"
        calib.write_text(
            "".join(
                json.dumps({"text": wikitext_detokenize(t)}) + "\n"
                for t in lines[:cut]
                if t.strip()
            )
        )
        lambada = root / "lambada.jsonl"
        passages = (DATA / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines(True)
        lambada.write_text("".join(passages[: args.lambada]), encoding="utf-8")
        ckpt = args.ckpt or root / "ckpt"
        if not (ckpt / "latest_checkpointed_iteration.txt").exists():
            start = time.perf_counter()
            # the text as `evaluate --task WIKITEXT103` scores it: detokenized (" @-@ " -> "-")
            params = train(args, wikitext_detokenize("".join(lines[:cut])), ckpt)
            print(f"trained {params / 1e6:.1f}M parameters in {time.perf_counter() - start:.0f} s")
        if args.train_only:
            return
        gigatron_to_hf(ckpt, root / "hf-fp32", log=lambda _: None)
        rows = [("fp32 (none)", 32, _ppl(ckpt, wiki, args.seq), *_lambada(ckpt, lambada),
                 _size(root / "hf-fp32"))]  # fmt: skip
        print(rows[-1], flush=True)
        for label, method, group, calibration in _runs(args, calib):
            out = root / method / label.split()[-1]
            quantize_checkpoint(ckpt, out, method, group, calibration=calibration)
            export_compressed(out, root / f"{method}-{out.name}-hf", log=lambda _: None)
            bits = 4 if method.startswith("int4") else 8
            rows.append((label, bits, _ppl(out, wiki, args.seq), *_lambada(out, lambada),
                         _size(root / f"{method}-{out.name}-hf")))  # fmt: skip
            print(rows[-1], flush=True)
        base = rows[0][-1]
        print("| method | bits | WikiText ppl | LAMBADA acc | LAMBADA target ppl | HF folder MiB "
              "| / fp32 |\n|---|---|---|---|---|---|---|")  # fmt: skip
        for label, bits, ppl, acc, target, size in rows:
            print(f"| {label} | {bits} | {ppl:.2f} | {acc:.4f} | {target:.1f} | "
                  f"{size / 2**20:.1f} | {size / base:.2f} |")  # fmt: skip
        assert all(math.isfinite(r[2]) for r in rows)


if __name__ == "__main__":
    main()
