"""`gigatron <command> --help` works for every command and every `pretrain` family: exit 0, a
usage line, the defaults shown, no traceback; the inference commands' help loads no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gigatron.cli import COMMANDS, main
from gigatron.families.registry import family_names

SRC = Path(__file__).resolve().parents[2] / "src"
# Commands whose flags all have defaults worth showing (others: positional arguments only, or the
# lm-evaluation-harness's own help; `data` and `detoxify` list their steps, whose own help
# test_corpus_tools.py and test_detoxify.py check).
SHOWS_DEFAULTS = set(COMMANDS) - {
    "text-generation-cli", "lm-eval", "presets", "plot", "data", "detoxify",
}  # fmt: skip


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), (argv, captured.err)
    assert "Traceback" not in captured.out + captured.err
    return captured.out


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"pretrain"}))
def test_every_command_help(capsys, command):
    out = _help(capsys, [command])
    assert "usage" in out.lower(), out
    if command in SHOWS_DEFAULTS:
        assert "default" in out, f"{command} --help shows no defaults"


@pytest.mark.parametrize("family", sorted(family_names()))
def test_every_pretrain_family_help(capsys, family):
    out = _help(capsys, ["pretrain", family])
    assert "--num-layers" in out and "default" in out


def test_presets_help_lists_the_presets_and_merge_shows_defaults(capsys):
    from gigatron.config.presets import PRESETS

    out = _help(capsys, ["presets"])
    assert all(name in out for name in PRESETS)
    assert "(default: False)" in _help(capsys, ["merge"])  # --multimodal


def test_serve_listens_on_this_machine_by_default(capsys):
    out = _help(capsys, ["serve"])
    assert "(default: 127.0.0.1)" in " ".join(out.split())


@pytest.mark.parametrize(
    "command",
    ["generate", "serve", "evaluate", "finetune", "text-generation-cli", "preprocess", "plot"],
)
def test_help_loads_no_torch(command):
    """Parsing comes before the torch-heavy imports: --help is quick."""
    code = (
        "import sys\nfrom gigatron.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().endswith("NO-TORCH"), result.stderr[-500:]
