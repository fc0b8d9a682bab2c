"""Every flag a gigatron command accepts does something: it is read by the code or refused with a
clear error (config/refusals.py). Flags are never abbreviated, each has help text, and the help
shows the default."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from gigatron.cli import COMMANDS
from gigatron.config import GigatronConfig, parse_config
from gigatron.config.equivalents import EQUIVALENTS
from gigatron.config.fields import flag_name
from gigatron.config.refusals import REFUSALS, refused_settings
from gigatron.config.root import SECTIONS, add_config_arguments, field_section
from gigatron.errors import GigatronError

SRC = Path(__file__).resolve().parents[2] / "src" / "gigatron"


def _pretrain_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gigatron pretrain gpt", allow_abbrev=False)
    add_config_arguments(parser)
    return parser


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from gigatron import quickstart
    from gigatron.checkpoint import convert, hf_convert
    from gigatron.data import merge, preprocess, train_tokenizer
    from gigatron.inference import generate, serve_command
    from gigatron.quantize import command as quantize_command
    from gigatron.tasks import evaluate, finetune, retro_preprocess
    from gigatron.training import plot_command

    return {
        **_step_parsers("data", "gigatron.data.corpus.command", "TOOLS"),
        **_step_parsers("detoxify", "gigatron.tasks.detoxify.command", "STEPS"),
        "quickstart": quickstart.build_parser,
        "preprocess": preprocess.build_parser,
        "merge": merge.build_parser,
        "train-tokenizer": train_tokenizer.build_parser,
        "pretrain": _pretrain_parser,
        "convert-checkpoint": convert._parser,
        "convert": hf_convert._parser,
        "generate": generate.build_parser,
        "serve": serve_command.build_parser,
        "evaluate": evaluate.build_parser,
        "finetune": finetune.build_parser,
        "plot": plot_command.build_parser,
        "quantize": quantize_command.build_parser,
        "retro-preprocess": retro_preprocess.build_parser,
    }


def _step_parsers(command: str, module: str, table: str) -> dict:
    """The parser of each step of a command with steps (`gigatron data clean`, ...)."""
    from gigatron.config.parser import command_parser

    steps = getattr(__import__(module, fromlist=["_"]), table)

    def build(step: str, add_flags) -> Callable[[], argparse.ArgumentParser]:
        def parser() -> argparse.ArgumentParser:
            made = command_parser(f"{command} {step}", "")
            add_flags(made)
            return made

        return parser

    return {f"{command} {step}": build(step, flags) for step, (_, flags, _) in steps.items()}


# `gigatron presets` takes no flags; `text-generation-cli` only HOST:PORT; `lm-eval` passes its
# flags to the lm-evaluation-harness command line.
NO_FLAGS = {"presets", "text-generation-cli", "lm-eval"}


def _long_option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if action.option_strings and action.dest not in ("help", "config")
    ]


def test_every_command_is_walked():
    assert {name.split()[0] for name in _parsers()} | NO_FLAGS == set(COMMANDS)


# ---- read or refused ------------------------------------------------------------------------------
# config/validate.py's functions that use values (with finalize_config's `_finalize_*` steps;
# the others only check them: rules).
_VALIDATE_USES = {"params_dtype", "data_parallel_size", "finalize_config", "freeze_config"}


def _source_without_rules(path: Path) -> str:
    """The source without what only checks values: the rules of config/validate.py and the
    families' `ACCEPTED_FIELDS` declarations (naming a field there does not use it)."""
    text = path.read_text()
    removed = []
    for node in ast.parse(text).body:
        rule = isinstance(node, ast.FunctionDef) and path == SRC / "config" / "validate.py"
        rule = rule and node.name not in _VALIDATE_USES and not node.name.startswith("_finalize")
        declaration = isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "ACCEPTED_FIELDS"
            for target in node.targets
        )
        if rule or declaration:
            removed.append(ast.get_source_segment(text, node) or "")
    for segment in removed:
        text = text.replace(segment, "")
    return text


def _sources(exclude: set[Path]) -> str:
    return "\n".join(
        _source_without_rules(path) for path in sorted(SRC.rglob("*.py")) if path not in exclude
    )


def _is_read(name: str, text: str) -> bool:
    return re.search(rf"\.{name}\b|[\"']{name}[\"']", text) is not None


def test_every_config_flag_is_read_or_refused():
    """A configuration field counts as read when some code outside its declaring section module
    (and outside the rules of config/validate.py) uses it; else config/refusals.py must refuse it."""
    unused = []
    for section, cls in SECTIONS.items():
        declaring = Path(__import__(cls.__module__, fromlist=["_"]).__file__).resolve()
        text = _sources({declaring, SRC / "config" / "refusals.py"})
        for field in dataclasses.fields(cls):
            if field.metadata.get("flag") == "":
                continue
            if not _is_read(field.name, text) and field.name not in REFUSALS:
                unused.append(f"{flag_name(field)} ({section}.{field.name})")
    assert unused == [], "flags accepted but neither read nor refused: " + ", ".join(unused)


def test_every_command_flag_is_read():
    text = _sources(set())
    unused = []
    for command, build in _parsers().items():
        if command == "pretrain":
            continue  # the configuration's flags: the test above
        for action in _long_option_actions(build()):
            if not _is_read(action.dest, text):
                unused.append(f"gigatron {command} {action.option_strings[0]}")
    assert unused == [], "flags accepted but never read: " + ", ".join(unused)


def test_refusals_name_real_fields_and_are_enforced():
    for name in REFUSALS:
        field_section(name)  # a KeyError here: the table names a field that does not exist
    assert refused_settings(GigatronConfig()) == [], "the defaults must be accepted"
    cases = {
        "timing_log_level": ["--timing-log-level", "2"],
        "transformer_impl": ["--transformer-impl", "inference_optimized"],
        "spec": ["--spec", "megatron.core.models.retro"],
        "fp8_amax_history_len": ["--fp8-amax-history-len", "1024"],
        "fp8_amax_compute_algo": ["--fp8-amax-compute-algo", "max"],
        "fp8_param_gather": ["--fp8-param-gather"],
        "nccl_ub": ["--use-nccl-ub"],
        "fsdp_double_buffer": ["--fsdp-double-buffer"],
        "fsdp_manual_registration": ["--fsdp-manual-registration"],
        "megatron_fsdp_main_grads_dtype": ["--megatron-fsdp-main-grads-dtype", "bf16"],
        "moe_router_force_load_balancing": ["--moe-router-force-load-balancing"],
        "moe_flex_dispatcher_backend": ["--moe-flex-dispatcher-backend", "hybridep"],
        "moe_token_dispatcher_type": ["--moe-token-dispatcher-type", "flex"],
        "muon_scalar_optimizer": ["--muon-scalar-optimizer", "lion"],
        "muon_use_syrk": ["--muon-use-syrk"],
        "exp_avg_dtype": ["--exp-avg-dtype", "fp8"],
        "exp_avg_sq_dtype": ["--exp-avg-sq-dtype", "fp16"],
        "main_params_dtype": ["--main-params-dtype", "fp16"],
        "main_grads_dtype": ["--main-grads-dtype", "bf16"],
    }
    assert set(cases) == set(REFUSALS), "give every refusal a refused example here"
    for flags in cases.values():
        # "--flag value", or a switch alone
        shown = flags[0] if len(flags) == 1 or flags[1].startswith("--") else " ".join(flags[:2])
        with pytest.raises(GigatronError, match=re.escape(f"{shown}: ")):
            parse_config(flags)


def test_equivalents_name_real_fields_and_are_documented():
    """Each implementation selector (config/equivalents.py) is a real flag, and
    docs/training.md says what it maps to."""
    docs = (SRC.parents[1] / "docs" / "training.md").read_text()
    for name, equivalent in EQUIVALENTS.items():
        field_section(name)
        flag = equivalent.flag.split()[0]
        assert f"`{flag}" in docs, f"docs/training.md does not explain {flag}"
        assert name not in REFUSALS or name in ("transformer_impl", "spec")


def test_expert_parallel_without_experts_is_refused_on_several_processes():
    with pytest.raises(GigatronError, match="--expert-model-parallel-size 2 needs --num-experts"):
        parse_config(["--expert-model-parallel-size", "2"], world_size=4)


def test_no_create_attention_mask_with_reset_attention_mask_is_refused():
    with pytest.raises(GigatronError, match="--reset-attention-mask needs the mask"):
        parse_config(["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"])
    cfg = parse_config(["--no-create-attention-mask-in-dataloader"])
    assert cfg.data.create_attention_mask_in_dataloader is False


# ---- parsing ------------------------------------------------------------------------------------
def test_every_parser_refuses_abbreviations_statically():
    """Every ArgumentParser built in src/ passes allow_abbrev=False (new ones too)."""
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name != "ArgumentParser":
                continue
            flags = {k.arg: k.value for k in node.keywords}
            value = flags.get("allow_abbrev")
            if not (isinstance(value, ast.Constant) and value.value is False):
                missing.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert missing == []


@pytest.mark.parametrize("argv", [["--hidden-siz", "64"], ["--train-iter", "3"]])
def test_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert f"{argv[0]}: unknown flag; did you mean --" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(_parsers()))
def test_abbreviations_of_each_command_are_refused(command, capsys):
    parser = _parsers()[command]()
    action = max(_long_option_actions(parser), key=lambda a: len(a.option_strings[0]))
    abbreviated = action.option_strings[0][:-1]
    with pytest.raises(SystemExit):
        parser.parse_args([abbreviated, "1"])
    assert abbreviated in capsys.readouterr().err


# ---- help ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", sorted(_parsers()))
def test_every_flag_has_help_and_its_default(command):
    """Each flag says what it does; one with a default (not None, not a switch) shows it."""
    problems = []
    parser = _parsers()[command]()
    for action in _long_option_actions(parser):
        flag = action.option_strings[0]
        if not action.help or action.help == argparse.SUPPRESS:
            problems.append(f"{flag}: no help text")
            continue
        # What --help prints (a formatter class may add the default).
        text = parser._get_formatter()._get_help_string(action)
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        shows = "default" in text
        if not switch and not action.required and action.default is not None and not shows:
            problems.append(f"{flag}: help does not show its default")
    assert problems == []


def test_quickstart_help_shows_the_defaults(capsys):
    from gigatron.quickstart import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 800)" in text and "(default: quickstart-run)" in text


def test_tiktoken_pattern_help_default_matches_the_docs():
    parser = _pretrain_parser()
    (action,) = [a for a in parser._actions if "--tiktoken-pattern" in a.option_strings]
    assert "(default: v2)" in action.help
    docs = (SRC.parents[1] / "docs" / "data.md").read_text()
    assert "`--tiktoken-pattern v1\\|v2` (default v2)" in docs
