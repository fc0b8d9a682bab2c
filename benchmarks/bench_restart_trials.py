"""Fault-injection trials of automatic restart: `torchrun --max-restarts 3` runs of a tiny GPT (2
ranks, --save = --load, deterministic mode) in which rank 1 kills itself with SIGKILL at a random
iteration of the first round; each must end with the losses of an uninterrupted run. Prints, per
trial, the format, the killed iteration, whether the losses match and the time from the kill to
the resumed iteration's log record.

    python benchmarks/bench_restart_trials.py --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from gigatron.cli import main
    from gigatron.training import loop

    kill_at = int(sys.argv[1])
    if kill_at and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        step = loop.train_step

        def dying(run, num_microbatches):
            if run.state.iteration + 1 == kill_at:
                print(f"KILL {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return step(run, num_microbatches)

        loop.train_step = dying
    sys.exit(main(sys.argv[2:]))
    """
)
FORMATS = {"torch": ["--ckpt-format", "torch"], "torch_dist": ["--ckpt-format", "torch_dist"],
           "async": ["--ckpt-format", "torch_dist", "--async-save"]}  # fmt: skip
ITERS = 8


def _launch(root: Path, name: str, kill_at: int, extra: list[str]) -> tuple[dict, str]:
    save = root / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "--max-restarts", "3", str(root / "launch.py"), str(kill_at), "pretrain",
               "gpt", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size",
               "64", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size",
               "2", "--global-batch-size", "4", "--train-iters", str(ITERS), "--log-interval",
               "1", "--lr", "1e-3", "--eval-iters", "0", "--deterministic-mode", "--save",
               str(save), "--load", str(save), "--save-interval", "2", *extra,
               "--metrics-file", str(root / f"{name}.jsonl")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    records = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["time"]) for r in records if r["type"] == "train"}, (
        out.stdout + out.stderr
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "launch.py").write_text(SCRIPT)
        clean = {f: _launch(root, f"clean_{f}", 0, extra)[0] for f, extra in FORMATS.items()}
        for trial in range(args.trials):
            name = list(FORMATS)[trial % len(FORMATS)]
            kill_at = rng.randint(2, ITERS)
            got, output = _launch(root, f"trial{trial}", kill_at, FORMATS[name])
            match = {i: v[0] for i, v in got.items()} == {i: v[0] for i, v in clean[name].items()}
            killed = re.search(r"KILL ([0-9.]+)", output)
            after = [t for _, t in got.values() if killed and t > float(killed.group(1))]
            restart = f"{min(after) - float(killed.group(1)):.1f} s" if after else "n/a"
            print(f"trial {trial}: {name:10s} killed at iteration {kill_at}: losses match "
                  f"{match}; kill -> next iteration logged {restart}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
