"""Megatron-LM's own example launch scripts run with `gigatron pretrain <family>`.

tests/data/megatron_example_flags.txt holds the flags each example script passes (extracted from
Megatron-LM; see tests/data/README.md). For each script below, its flags are parsed by gigatron
exactly as written except for:
- sizes shrunk (SHRINK, and the script's own `shrink`), so that 3 iterations run on a CPU;
- paths and shell variables replaced (`replace`: every `$VAR` value must be);
- flags dropped, each with its reason (`drop`: features gigatron refuses, CUDA-only switches);
- flags added (`add`: e.g. `--mock-data` in place of a data path).
A flag gigatron does not know fails the test (argparse exits), as does one it accepts and
refuses. Adding a script is one `Example(...)` entry.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gigatron.training.pretrain import parse_pretrain_config, pretrain

DATA = Path(__file__).resolve().parents[1] / "data"
SPEC = DATA / "megatron_example_flags.txt"

# Model and run sizes every script gets when it sets them (values that fit a 2-core CPU).
SHRINK = {
    "--num-layers": "2",
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--num-attention-heads": "4",
    "--num-query-groups": "2",
    "--kv-channels": "16",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--micro-batch-size": "2",
    "--global-batch-size": "4",
    "--train-iters": "3",
    "--train-samples": "12",
    "--lr-decay-samples": "12",
    "--lr-warmup-samples": "4",
    "--lr-decay-iters": "3",
    "--lr-warmup-iters": "1",
    "--log-interval": "1",
    "--eval-interval": "3",
    "--eval-iters": "1",
    "--save-interval": "3",
    "--num-workers": "0",
    "--tensor-model-parallel-size": "1",
    "--pipeline-model-parallel-size": "1",
    "--context-parallel-size": "1",
    "--expert-model-parallel-size": "1",
    "--exit-duration-in-mins": "30",
    "--distributed-timeout-minutes": "5",
    "--vocab-size": "512",
    "--profile-step-start": "1",
    "--profile-step-end": "2",
}

# Reasons shared by several scripts.
FP8 = (
    "fp8 with delayed scaling (Megatron's default --fp8-recipe, the amax history) is refused; "
    "gigatron's fp8 is torchao's dynamic scaling (--fp8-recipe tensorwise|rowwise)"
)
FSDP_TUNING = "a Megatron-FSDP NCCL tuning, refused: config/refusals.py"
CUDA_ONLY = "records CUDA allocations: an error on a CPU"
REAL_DATA_BRANCH = "the script's real-data branch; the test runs its --mock-data branch"
WANDB = "Weights & Biases needs an account and the network"
FLASH_ATTN = "the flash-attn package (GPU only) is not installed on the CPU test machine"
FSDP_DTENSOR = "--ckpt-format fsdp_dtensor (Megatron-FSDP's own format) is not available"
REFUSED = "refused: config/refusals.py"
HUB_TOKENIZER = "a Hugging Face hub tokenizer needs the network; NullTokenizer instead"
FP8_FLAGS = {
    "--fp8-format": FP8,
    "--fp8-amax-history-len": FP8,
    "--fp8-amax-compute-algo": FP8,
    "--fp8-param-gather": FP8,
}
MOCK_BRANCH = {
    "--data-path": REAL_DATA_BRANCH,
    "--tokenizer-model": REAL_DATA_BRANCH,
}


@dataclass(frozen=True)
class Example:
    section: str  # the script's path in Megatron-LM (its section in the spec file)
    family: str
    replace: dict[str, str] = field(default_factory=dict)  # flag -> value (paths, variables)
    drop: dict[str, str] = field(default_factory=dict)  # flag -> why it is left out
    add: tuple[str, ...] = ()
    # Flags listed with several values (shell branches): the one the test keeps.
    choose: dict[str, str] = field(default_factory=dict)
    nproc: int = 1  # > 1: under torchrun


def _gpt2_files() -> dict[str, str]:
    return {
        "--vocab-file": str(DATA / "gpt2-vocab.json"),
        "--merge-file": str(DATA / "gpt2-merges.txt"),
    }


EXAMPLES = {
    "gpt3_175b": Example(
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        "gpt",
        replace={
            **_gpt2_files(),
            # Thresholds are tokens: 2 samples of 64 tokens at batch 2, then batch 4.
            "--step-batch-size-schedule": "0:2 128:4",
        },
        drop={"--data-path": "replaced by --mock-data"},
        add=("--mock-data",),
    ),
    "bert_340m": Example(
        "examples/bert/train_bert_340m_distributed.sh",
        "bert",
        replace={"--vocab-file": str(DATA / "bert-base-uncased-vocab.txt")},
        drop={"--data-path": "replaced by --mock-data"},
        add=("--mock-data",),
    ),
    "mamba": Example(
        "examples/mamba/train.sh",
        "mamba",
        replace={
            "--hybrid-layer-pattern": "M*-",
            "--tokenizer-model": str(DATA / "spm-botchan-unigram-1000.model"),
        },
        drop={"--data-path": "replaced by --mock-data"},
        add=(
            "--mock-data",
            "--mamba-state-dim",
            "8",
            "--mamba-head-dim",
            "16",
            "--mamba-num-groups",
            "2",
        ),  # fmt: skip
    ),
    "llama3_8b_fp8": Example(
        "examples/llama/train_llama3_8b_h100_fp8.sh",
        "gpt",
        drop={
            **FP8_FLAGS,
            **MOCK_BRANCH,
        },
        choose={"--tokenizer-type": "NullTokenizer"},
    ),
    "llama3_8b_fsdp": Example(
        "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
        "gpt",
        replace={"--data-parallel-sharding-strategy": "optim_grads_params"},
        drop={
            **FP8_FLAGS,
            **MOCK_BRANCH,
            "--ckpt-format": FSDP_DTENSOR,
            "--use-nccl-ub": FSDP_TUNING,
            "--fsdp-double-buffer": FSDP_TUNING,
            "--fsdp-manual-registration": FSDP_TUNING,
            "--init-model-with-meta-device": REFUSED,
            "--record-memory-history": CUDA_ONLY,
        },
        choose={"--tokenizer-type": "NullTokenizer"},
        nproc=2,  # FSDP over 2 data-parallel ranks
    ),
    "mixtral_8x7b": Example(
        "examples/mixtral/train_mixtral_8x7b_distributed.sh",
        "gpt",
        replace={
            "--tokenizer-model": str(DATA / "spm-botchan-unigram-1000.model"),
            # The mock data's 10000 sequences leave 99990,8,2 no test sequence.
            "--split": "98,1,1",
        },
        drop={
            "--data-path": "replaced by --mock-data",
            "--wandb-project": WANDB,
            "--wandb-exp-name": WANDB,
        },
        add=("--mock-data",),
    ),
    "t5_220m": Example(
        "examples/t5/train_t5_220m_distributed.sh",
        "t5",
        replace={
            "--vocab-file": str(DATA / "bert-base-uncased-vocab.txt"),
            "--encoder-num-layers": "2",
            "--decoder-num-layers": "2",
            "--encoder-seq-length": "64",
            "--decoder-seq-length": "16",
            "--split": "98,1,1",  # the mock data's sequences must reach each split
        },
        drop={"--data-path": "replaced by --mock-data"},
        add=("--mock-data",),
    ),
    "gpt_oss": Example(
        "examples/gptoss/02_train.sh",
        "gpt",
        replace={"--moe-ffn-hidden-size": "64"},
        drop={**FP8_FLAGS, **MOCK_BRANCH, "--use-flash-attn": FLASH_ATTN},
        choose={"--tokenizer-type": "NullTokenizer"},
    ),
    "deepseek_v3": Example(
        "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
        "gpt",
        replace={
            "--data-parallel-sharding-strategy": "optim_grads_params",
            "--tokenizer-type": "NullTokenizer",
            # 16 experts in 8 groups of 2: the best 4 groups hold the 8 experts to choose.
            "--num-experts": "16",
            "--moe-layer-freq": "[0]*1+[1]*1",
            "--moe-ffn-hidden-size": "64",
            "--moe-shared-expert-intermediate-size": "64",
            "--q-lora-rank": "32",
            "--kv-lora-rank": "16",
            "--qk-head-dim": "16",
            "--qk-pos-emb-head-dim": "8",
            "--v-head-dim": "16",
            "--make-vocab-size-divisible-by": "128",
        },
        drop={
            "--tokenizer-model": HUB_TOKENIZER,
            "--data-path": "replaced by --mock-data",
            "--use-flash-attn": FLASH_ATTN,
            "--moe-token-dispatcher-type": REFUSED + " (flex: DeepEP / HybridEP)",
            "--moe-flex-dispatcher-backend": REFUSED,
            "--moe-router-force-load-balancing": REFUSED,
            "--init-model-with-meta-device": REFUSED,
            "--ckpt-format": FSDP_DTENSOR,
            "--fsdp-double-buffer": FSDP_TUNING,
            "--use-nccl-ub": FSDP_TUNING,
            "--megatron-fsdp-main-grads-dtype": REFUSED,
            "--wandb-project": WANDB,
            "--wandb-exp-name": WANDB,
        },
        add=("--mock-data", "--vocab-size", "512"),
    ),
    "detoxify_1p3b": Example(
        "examples/academic_paper_scripts/detxoify_lm/finetune_gpt_distributed-1.3b.sh",
        "gpt",
        replace={**_gpt2_files(), "--lr": "1e-4"},
        drop={"--data-path": "replaced by --mock-data"},
        add=("--mock-data",),
    ),
}


def script_flags(section: str) -> list[tuple[str, str | None]]:
    """(flag, value or None) of one script's section, in order; flags the extraction marks as
    not Megatron's (the script's own options) are left out."""
    text = SPEC.read_text()
    match = re.search(rf"^### {re.escape(section)}\n(.*?)(?=^### |\Z)", text, re.M | re.S)
    assert match, f"{section}: no such section in {SPEC.name}"
    flags = []
    for line in match.group(1).splitlines():
        if not line.startswith("--") or "[not in arguments.py parser]" in line:
            continue
        name, _, value = line.partition(" ")
        flags.append((name, value.strip().strip("'") or None))
    return flags


def example_argv(example: Example, workdir: Path) -> list[str]:
    """The script's flags with the substitutions of the module docstring."""
    paths = {
        "--save": workdir / "ckpt",
        "--load": workdir / "ckpt",
        "--tensorboard-dir": workdir / "tb",
        "--data-cache-path": workdir / "cache",
    }
    argv, seen = [], set()
    for name, value in script_flags(example.section):
        if name in example.drop or name in seen:
            continue
        if name in example.choose and value != example.choose[name]:
            continue
        seen.add(name)
        if name in example.replace:
            value = example.replace[name]
        elif name in paths:
            value = str(paths[name])
        elif name in SHRINK:
            value = SHRINK[name]
        assert value is None or "$" not in value, f"{example.section}: {name} {value} not replaced"
        argv += [name] if value is None else [name, value]
    return argv + list(example.add)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_script_runs_three_iterations(name, tmp_path):
    example = EXAMPLES[name]
    argv = example_argv(example, tmp_path)
    if example.nproc > 1:
        losses = _run_under_torchrun(example, argv, tmp_path)
        assert sorted(losses) == [1, 2, 3]
        assert all(math.isfinite(loss) for loss in losses.values())
        return
    cfg = parse_pretrain_config(argv, world_size=1, family=example.family)
    stream = io.StringIO()
    result, _ = pretrain(cfg, stream=stream, family=example.family, progress_bar=False)
    assert result.iteration == 3
    assert len(result.train_losses) == 3
    assert all(math.isfinite(loss) for loss in result.train_losses.values())
    if name == "gpt3_175b":
        # Its batch schedule (shrunk): batch 2 until 128 tokens are consumed, then 4.
        batches = re.findall(r"global batch size:\s+(\d+)", stream.getvalue())
        samples = re.findall(r"consumed samples:\s+(\d+)", stream.getvalue())
        assert batches == ["2", "4", "4"] and samples == ["2", "6", "10"]


def _run_under_torchrun(example: Example, argv: list[str], workdir: Path) -> dict[int, float]:
    """Run under torchrun; the train losses from metrics.jsonl."""
    metrics = workdir / "metrics.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(example.nproc), "-m", "gigatron.cli", "pretrain", example.family, *argv,
        "--metrics-file", str(metrics), "--no-progress-bar",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if r["type"] == "train"}


def test_every_dropped_flag_is_in_its_script():
    """A drop, replacement or choice names a flag the script really passes (no stale entries)."""
    for name, example in EXAMPLES.items():
        flags = {flag for flag, _ in script_flags(example.section)}
        for listed in (*example.drop, *example.replace, *example.choose):
            assert listed in flags, f"{name}: {listed} is not among the script's flags"
