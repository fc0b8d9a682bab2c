"""Multi-node launches on this machine: two torchrun agents (`--nnodes 2 --rdzv-backend c10d`,
2 processes each) meeting on localhost give the losses of the same run launched on one node;
examples/slurm/slurm_env.sh turns a Slurm task's variables into the torchrun environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TIMEOUT_S, env, gigatron_command, run, tiny_gpt_flags, train_values

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(tmp_path: Path, name: str) -> list[str]:
    return ["pretrain", "gpt", *tiny_gpt_flags(), "--global-batch-size", "8",
            "--train-iters", "3", "--log-interval", "1", "--lr", "1e-3", "--eval-iters", "0",
            "--deterministic-mode", "--save", str(tmp_path / name), "--save-interval", "3",
            "--metrics-file", str(tmp_path / f"{name}.jsonl")]  # fmt: skip


def _together(commands: list[list[str]], environments: list[dict[str, str]]) -> None:
    """Start every command, then wait for all (each must exit 0 within the timeout)."""
    processes = [
        subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c, e in zip(commands, environments)
    ]
    outputs = []
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    codes = [p.returncode for p in processes]
    assert codes == [0] * len(processes), "\n".join(outputs)


def test_two_nodes_of_two_match_one_node(tmp_path):
    run(gigatron_command(*_args(tmp_path, "one_node"), nproc=4))
    port = _free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gigatron-test",
             "-m", "gigatron.cli", *_args(tmp_path, "two_nodes")]  # fmt: skip
    _together([agent, agent], [env(), env()])
    one_node = train_values(tmp_path / "one_node.jsonl")
    assert sorted(one_node) == [1, 2, 3]
    assert train_values(tmp_path / "two_nodes.jsonl") == one_node
    # every node wrote its part of the checkpoint into the one folder
    assert (tmp_path / "two_nodes" / "latest_checkpointed_iteration.txt").read_text() == "3\n"


def test_the_slurm_script_sets_the_torchrun_environment(tmp_path):
    """examples/slurm/slurm_env.sh: what srun gives a task becomes what gigatron reads."""
    script = str(ROOT / "examples" / "slurm" / "slurm_env.sh")
    scontrol = tmp_path / "scontrol"  # Slurm's node-list expansion, as on a cluster
    # A long node list: a reader that stops at the first line would SIGPIPE it (pipefail).
    scontrol.write_text("#!/bin/sh\necho node-a\nseq -f 'node-%g' 1 200000\n")
    scontrol.chmod(0o755)
    slurm = env(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1",
                SLURM_NTASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="node-[a-b]",
                PATH=f"{tmp_path}:{os.environ['PATH']}")  # fmt: skip
    slurm.pop("MASTER_ADDR", None)
    slurm.pop("MASTER_PORT", None)
    result = run(["bash", script, "env"], environment=slurm)
    values = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert {k: values[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT")} == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}  # fmt: skip
    outside = run(["bash", script, "env"], environment=env(SLURM_PROCID=""), check=False)
    assert outside.returncode != 0 and "run this under srun" in outside.stderr
