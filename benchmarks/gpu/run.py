"""The GPU run: checks, then training benchmarks, one JSON and the BENCHMARKS.md rows.

1. The machine: versions of torch, CUDA, Triton and the optional libraries, the device, and
   its measured bf16 matrix rate (an 8192^3 product on random data, median of 10 after 3
   warm-ups), the ceiling for MFU.
2. benchmarks/gpu/gpu_checks.py under pytest on the device (bf16, fp16 with loss scaling, each
   fused kernel against the PyTorch path, compile, fp8, checkpoint save and resume, the
   inference engine); each check passed, failed or skipped with its reason.
3. benchmarks/gpu/bench.py for each model and variant (a fresh process each: its own memory
   and compile caches): tokens/s, step time, MFU, peak memory; a variant whose library is
   missing is skipped with the reason, one that fails is recorded with its error.
Writes `<out>/results.json`, `<out>/rows.md` (the BENCHMARKS.md section) and
`<out>/checks.log` (`--out` defaults to $OUT, the device tool's folder); `--merge` joins
the results of several calls (one device call runs at most 10 minutes: benchmarks/gpu/README.md).
`--dry-run` does all of it on the CPU at tiny shapes (tests/unit/test_gpu_script.py).

    python benchmarks/gpu/run.py [--dry-run] [--out DIR] [--models gpt-1.3b,...]
        [--variants gigatron_eager,...] [--skip-checks] [--skip-bench] [--no-compile]
        [--budget-s 540] [--steps 10 --warmup 5]
    python benchmarks/gpu/run.py --merge a/results.json b/results.json --out DIR
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench.py beside this file

import bench  # noqa: E402

LIBRARIES = ("torch", "triton", "liger-kernel", "torchao", "megatron-core", "transformers")


def environment(device: str) -> dict:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info = {"python": platform.python_version(), "versions": versions, "device": device}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def matmul_tflops(device: str, dry_run: bool) -> dict:
    """The measured matrix rate: bf16 8192^3 on a GPU (fp32 256^3 in the dry run)."""
    n, dtype = (256, torch.float32) if dry_run else (8192, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    times = []
    for index in range(13):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            a @ b
            elapsed = time.perf_counter() - begin
        if index >= 3:
            times.append(elapsed)
    rate = 2 * n**3 / statistics.median(times) / 1e12
    return {"size": n, "dtype": str(dtype).removeprefix("torch."), "tflops": rate}


def run_checks(args: argparse.Namespace) -> list[dict]:
    """gpu_checks.py under pytest: one {name, outcome, message} per check."""
    report = Path(tempfile.mkdtemp()) / "checks.xml"  # $OUT brings back 8 files at most
    env = {**os.environ, "GIGATRON_CHECK_DEVICE": args.device}
    if args.no_compile:
        env["GIGATRON_CHECK_NO_COMPILE"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               str(HERE / "gpu_checks.py"), f"--junitxml={report}"]  # fmt: skip
    log = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.budget_s)
    (args.out / "checks.log").write_text(log.stdout + log.stderr)
    if not report.is_file():
        return [{"name": "pytest", "outcome": "failed", "message": log.stdout[-2000:]}]
    checks = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (element.get("message") or "")[:500]
        checks.append({"name": case.get("name"), "outcome": outcome, "message": message})
    return checks


def bench_one(model: str, variant: str, args: argparse.Namespace, seconds: float) -> dict:
    """One variant in a fresh process (or this one with --in-process)."""
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    common += ["--dry-run"] * args.dry_run + ["--no-compile"] * args.no_compile
    if args.in_process:
        out = Path(tempfile.mkdtemp()) / "result.json"
        bench.main(["--model", model, "--variant", variant, "--out", str(out), *common])
        return json.loads(out.read_text())
    out = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, str(HERE / "bench.py"), "--model", model, "--variant", variant,
               "--out", str(out), *common]  # fmt: skip
    try:
        log = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"model": model, "variant": variant, "status": "failed",
                "reason": f"timed out after {seconds:.0f} s"}  # fmt: skip
    if not out.is_file():
        return {"model": model, "variant": variant, "status": "failed",
                "reason": f"exit {log.returncode}: {(log.stdout + log.stderr)[-1500:]}"}  # fmt: skip
    result = json.loads(out.read_text())
    if result["status"] == "failed":  # what the command printed says why
        output = log.stdout + log.stderr
        result["output_tail"] = output[-3000:]
        errors = [line for line in output.splitlines() if "error:" in line]
        result["reason"] += f" ({errors[-1].strip()})" if errors else ""
    return result


def run_benchmarks(args: argparse.Namespace, deadline: float) -> list[dict]:
    results = []
    for model in args.models:
        for variant in args.variants:
            left = deadline - time.monotonic()
            if left < 30:
                results.append({"model": model, "variant": variant, "status": "skipped",
                                "reason": "this call's time budget is spent"})  # fmt: skip
                continue
            result = bench_one(model, variant, args, min(left, args.variant_timeout_s))
            results.append(result)
            print(f"{model} {variant}: {result['status']} {result.get('tokens_per_s', '')} "
                  f"{result.get('reason', '')}", flush=True)  # fmt: skip
    return results


def mfu(result: dict, peak: dict | None) -> float | None:
    if result.get("status") != "ok" or not peak:
        return None
    return result["achieved_tflops"] / peak["tflops"]


def rows(report: dict) -> str:
    """The BENCHMARKS.md section of a report."""
    env, peak = report["environment"], report.get("matmul")
    versions = ", ".join(f"{name} {v}" for name, v in env["versions"].items() if v)
    machine = f"{env.get('gpu', env['device'])}, Python {env['python']}, {versions}"
    ceiling = f"{peak['tflops']:.3g} TFLOP/s ({peak['dtype']} {peak['size']}^3)" if peak else "-"
    lines = [
        "## GPU training throughput (issue 26)",
        f"Command: `{report['command']}`. Machine: {machine}. Date: {report['date']}. "
        f"Measured matrix rate, the MFU ceiling: {ceiling}.",
        "",
        "| model | variant | tokens/s | step (ms) | MFU | peak memory (GiB) | vs gigatron eager |",
        "|---|---|---|---|---|---|---|",
    ]
    eager = {r["model"]: r for r in report["results"] if r["variant"] == "gigatron_eager"}
    for r in report["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['variant']} | {r['status']}: "
                         f"{r.get('reason', '')[:120]} | | | | |")  # fmt: skip
            continue
        base = eager.get(r["model"], {}).get("tokens_per_s")
        memory = (r.get("peak_memory_bytes") or 0) / 2**30
        utilisation = mfu(r, peak)
        shown_mfu = "" if utilisation is None else f"{utilisation:.1%}"
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:,.0f} | "
            f"{1000 * r['step_s']:.1f} | {shown_mfu} | {memory:.1f} | {speed} |"
        )
    checks = report.get("checks", [])
    if checks:
        counts = {
            o: sum(c["outcome"] == o for c in checks) for o in ("passed", "failed", "skipped")
        }
        lines += ["", "Checks (gpu_checks.py): " + ", ".join(f"{n} {o}" for o, n in counts.items())]
        lines += [f"- {c['name']}: {c['outcome']} {c['message'][:160]}"
                  for c in checks if c["outcome"] != "passed"]  # fmt: skip
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "rows.md").write_text(rows(report))
    print(rows(report))


def merge(paths: list[Path], out: Path) -> None:
    reports = [json.loads(p.read_text()) for p in paths]
    merged = dict(reports[0])
    merged["checks"] = [c for r in reports for c in r.get("checks", [])]
    merged["results"] = [x for r in reports for x in r.get("results", [])]
    merged["command"] = " ; ".join(r["command"] for r in reports)
    write(merged, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or HERE / "out"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--models", default=",".join(bench.MODELS))
    parser.add_argument("--variants", default=",".join(bench.DEFAULT_VARIANTS))
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile anywhere")
    parser.add_argument("--in-process", action="store_true", help="variants in this process")
    parser.add_argument("--budget-s", type=float, default=540.0, help="this call's time")
    parser.add_argument("--variant-timeout-s", type=float, default=240.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--merge", type=Path, nargs="+", help="results.json files to join")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = (set(args.models) - set(bench.MODELS)) | (set(args.variants) - set(bench.VARIANTS))
    if unknown:
        parser.error(f"unknown model or variant: {', '.join(sorted(unknown))}")
    args.device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return 0
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join(["python benchmarks/gpu/run.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment(args.device),
        "matmul": matmul_tflops(args.device, args.dry_run),
        "checks": [] if args.skip_checks else run_checks(args),
        "results": [] if args.skip_bench else run_benchmarks(args, deadline),
    }
    write(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
