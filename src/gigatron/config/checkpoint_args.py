"""The flags Megatron's checkpoint-reading entry points accept (tasks/main.py,
tools/run_text_generation_server.py), for the commands that read a trained checkpoint:
`evaluate`, `serve` and `generate` (`finetune` parses every section itself).

A Megatron command line repeats the model's shape (`--num-layers 24 --hidden-size 1024 ...`),
its parallel layout and tokenizer; gigatron reads them from the checkpoint's saved configuration,
so each given flag is checked against it: equal is fine, different is an error naming both
values, absent from the checkpoint (None there) is used. `--fp16`/`--bf16` choose the dtype the
model runs in. The loader flags (`--no-load-optim`, `--no-load-rng`, `--finetune`) say what these
commands always do (weights only), and `--log-interval` paces their progress lines.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection
from typing import Any

from gigatron.config.fields import add_dataclass_arguments, field_types, flag_name
from gigatron.errors import GigatronError

# Tokenizer files may move after training: the commands take them as overrides, not checks.
TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")
# The parallel layout the checkpoint was saved with (the run's layout when it loads).
PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)
PRECISION = ("fp16", "bf16")
# What loading for inference always does; the flags are accepted in Megatron's meaning.
LOADER = ("no_load_optim", "no_load_rng", "finetune")
PACING = ("log_interval",)
# What fixes the shapes of a checkpoint's parameters and its vocabulary: `finetune` checks these
# against its --pretrained-checkpoint (dropout, sequence length, ... may change for fine-tuning).
PARAMETER_SHAPES = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "group_query_attention",
    "num_query_groups",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "make_vocab_size_divisible_by",
    "padded_vocab_size",
    "tokenizer_type",
)


def _section_fields(section: str) -> list[dataclasses.Field]:
    from gigatron.config.root import SECTIONS  # why: root imports every section; keep it lazy

    return list(dataclasses.fields(SECTIONS[section]))


def accepted_fields(skip: Collection[str] = ()) -> dict[str, list[str]]:
    """section -> field names of the Megatron flags a checkpoint-reading command accepts."""
    picked = {
        "model": [f.name for f in _section_fields("model")],
        "moe": [f.name for f in _section_fields("moe")],
        "tokenizer": [f.name for f in _section_fields("tokenizer") if f.name not in TOKENIZER_FILES],
        "parallel": list(PARALLEL_SIZES),
        "training": list(PRECISION),
        "checkpoint": list(LOADER),
        "logging": list(PACING),
    }
    return {section: [n for n in names if n not in skip] for section, names in picked.items()}


def add_checkpoint_arguments(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    """Add the accepted Megatron flags (but those in `skip`, which the command defines itself);
    a flag not typed is absent from the namespace."""
    from gigatron.config.root import SECTIONS  # why: see _section_fields

    # The command's own flags of the same names (e.g. evaluate's window --seq-length) are not
    # checked against the checkpoint.
    parser.set_defaults(unchecked_flags=tuple(skip))
    for section, names in accepted_fields(skip).items():
        cls = SECTIONS[section]
        hints = field_types(cls)
        chosen = [f for f in dataclasses.fields(cls) if f.name in names]
        subset = dataclasses.make_dataclass(
            cls.__name__,
            [(f.name, hints[f.name], _copy_field(f)) for f in chosen],
        )
        title = f"Megatron {section} flags (checked against the checkpoint)"
        if section in ("training", "checkpoint", "logging"):
            title = f"Megatron {section} flags"
        add_dataclass_arguments(parser, subset, title=title)


def _copy_field(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=field.default_factory, metadata=field.metadata)
    return dataclasses.field(default=field.default, metadata=field.metadata)


def given_flags(namespace: argparse.Namespace) -> dict[str, Any]:
    """The accepted Megatron flags the user typed: field name -> value."""
    skip = getattr(namespace, "unchecked_flags", ())
    names = [n for fields in accepted_fields(skip).values() for n in fields]
    return {name: getattr(namespace, name) for name in names if hasattr(namespace, name)}


def apply_checkpoint_flags(cfg: Any, namespace: argparse.Namespace, only: Collection[str] | None = None) -> None:
    """Check the typed shape/layout/tokenizer flags against the checkpoint's configuration `cfg`
    (filling what it does not record) and apply the precision flags; every mismatch is named in
    one error. `only`: check these fields alone (fine-tuning may change the rest)."""
    from gigatron.config.root import field_section  # why: see _section_fields

    given = given_flags(namespace)
    if only is not None:
        given = {name: value for name, value in given.items() if name in only}
    if given.get("fp16") and given.get("bf16"):
        raise GigatronError("--fp16 and --bf16: choose one")
    mismatches = []
    for name, value in given.items():
        section = field_section(name)
        if name in PRECISION:
            if value:
                cfg.training.fp16, cfg.training.bf16 = name == "fp16", name == "bf16"
            continue
        if section in ("checkpoint", "logging"):
            continue
        saved = getattr(getattr(cfg, section), name)
        if saved is None:
            setattr(getattr(cfg, section), name, value)
        elif saved != value:
            mismatches.append(f"{_flag(section, name)} {_shown(value)} (checkpoint: {_shown(saved)})")
    if mismatches:
        raise GigatronError(
            f"{'; '.join(mismatches)}: differ from the configuration saved in the checkpoint; "
            "drop these flags (the checkpoint's values are used) or give the saved values"
        )


def _flag(section: str, name: str) -> str:
    from gigatron.config.root import SECTIONS  # why: see _section_fields

    (field,) = [f for f in dataclasses.fields(SECTIONS[section]) if f.name == name]
    return flag_name(field)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)
