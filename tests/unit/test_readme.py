"""The README's commands, as a new user runs them: the CPU install comes first, and both
pretraining examples are valid runs of the size the README says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from gigatron.families.gpt.flops import model_flops_per_iteration
from gigatron.training.pretrain import parse_pretrain_config

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def _commands(block: str) -> list[str]:
    """Commands of a block, continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def test_the_first_block_installs_a_cpu_torch_before_gigatron():
    first = _commands(_bash_blocks()[0])
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in first
    install = next(i for i, c in enumerate(first) if c.startswith("pip install -e ."))
    assert first.index(cpu) < install  # before gigatron pulls a default (CUDA) torch
    assert "CPU-only" in _bash_blocks()[0] and "GPU machine" in _bash_blocks()[0]


def _pretrain_commands() -> dict[int, list[str]]:
    """nproc -> flags of each `torchrun ... pretrain gpt` command of the workflow block."""
    found = {}
    for block in _bash_blocks():
        for command in _commands(block):
            words = shlex.split(command)
            if words[:2] == ["torchrun", "--nproc-per-node"] and "--num-layers" in words:
                found[int(words[2])] = words[words.index("gpt") + 1 :]
    return found


def test_the_pretraining_examples_are_valid_and_sized_as_said():
    commands = _pretrain_commands()
    assert sorted(commands) == [2, 4]
    gpu = parse_pretrain_config(commands[4], world_size=4)
    cpu = parse_pretrain_config(commands[2], world_size=2)
    assert gpu.training.bf16 and not cpu.training.bf16  # bf16 needs a GPU
    assert "Sized for 4 GPUs" in README and "sized for a CPU" in README
    vocab = 32000  # the workflow's tokenizer
    ratio = model_flops_per_iteration(
        gpu.model, gpu.training.global_batch_size, vocab
    ) / model_flops_per_iteration(cpu.model, cpu.training.global_batch_size, vocab)
    assert ratio > 20, f"the CPU variant is only {ratio:.1f} x lighter"
    assert "iteration 1 running..." in README
