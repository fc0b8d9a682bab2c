"""The whole configuration, its flag parser and its YAML form."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gigatron.config.checkpoint import CheckpointConfig
from gigatron.config.data import DataConfig
from gigatron.config.fields import add_dataclass_arguments, coerce_value
from gigatron.config.logging import LoggingConfig
from gigatron.config.model import ModelConfig
from gigatron.config.moe import MoEConfig
from gigatron.config.optimizer import OptimizerConfig
from gigatron.config.parallel import ParallelConfig
from gigatron.config.parser import FlagParser
from gigatron.config.retro import RetroConfig
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.config.training import TrainingConfig
from gigatron.config.validate import finalize_config, validate_config
from gigatron.errors import GigatronError


@dataclass
class GigatronConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    retro: RetroConfig = field(default_factory=RetroConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(GigatronConfig)}

# field name -> section name; field names are unique across sections (checked below).
FIELD_SECTION: dict[str, str] = {}
for _section, _cls in SECTIONS.items():
    for _f in dataclasses.fields(_cls):
        assert _f.name not in FIELD_SECTION, f"config field {_f.name} declared twice"
        FIELD_SECTION[_f.name] = _section


def field_section(name: str) -> str:
    """The section (`model`, `training`, ...) that declares configuration field `name`."""
    return FIELD_SECTION[name]


def add_config_arguments(parser: argparse.ArgumentParser, sections: Sequence[str] | None = None) -> None:
    """Add the flags of the given sections (all by default) and `--config`."""
    parser.add_argument(
        "--config",
        "--yaml-cfg",
        dest="config",
        default=None,
        metavar="FILE",
        help="YAML file with configuration values; flags given on the command line override it",
    )
    for name in sections or SECTIONS:
        add_dataclass_arguments(parser, SECTIONS[name], title=f"{name} options")


def config_from_dict(
    values: dict[str, Any], source: str = "config", base: GigatronConfig | None = None
) -> GigatronConfig:
    """Build a config from flat `{field: value}` or nested `{section: {field: value}}` mappings."""
    cfg = base if base is not None else GigatronConfig()
    flat: dict[str, Any] = {}
    for key, value in values.items():
        key_norm = key.replace("-", "_")
        if key_norm in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                flat[sub_key.replace("-", "_")] = sub_value
        else:
            flat[key_norm] = value
    unknown = sorted(k for k in flat if k not in FIELD_SECTION)
    if unknown:
        raise GigatronError(
            f"{source}: unknown configuration key(s) {', '.join(unknown)}; "
            "keys are Megatron flag names with underscores (see `gigatron pretrain gpt --help`)"
        )
    for key, value in flat.items():
        section = getattr(cfg, FIELD_SECTION[key])
        setattr(section, key, coerce_value(type(section), key, value, source))
    return cfg


def config_to_dict(cfg: GigatronConfig) -> dict[str, dict[str, Any]]:
    """Nested plain-Python form (YAML- and JSON-safe)."""
    return dataclasses.asdict(cfg)


def load_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise GigatronError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise GigatronError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise GigatronError(f"--config {path}: the top level must be a mapping of option: value")
    return data


def config_from_namespace(namespace: argparse.Namespace, base: GigatronConfig | None = None) -> GigatronConfig:
    """Config from parsed flags: dataclass defaults (or `base`), then the YAML file, then typed
    flags."""
    cfg = base if base is not None else GigatronConfig()
    if getattr(namespace, "config", None):
        cfg = config_from_dict(load_yaml(namespace.config), source=namespace.config, base=cfg)
    for key, value in vars(namespace).items():
        if key in FIELD_SECTION:
            setattr(getattr(cfg, FIELD_SECTION[key]), key, value)
    return cfg


def parse_config(
    argv: Sequence[str] | None = None,
    prog: str = "gigatron",
    validate: bool = True,
    world_size: int | None = None,
) -> GigatronConfig:
    """Parse flags (and `--config`) into a finalized, validated config."""

    parser = FlagParser(prog=prog, allow_abbrev=False)
    add_config_arguments(parser)
    namespace = parser.parse_args(argv)
    cfg = config_from_namespace(namespace)
    finalize_config(cfg, world_size=world_size)
    if validate:
        validate_config(cfg, world_size=world_size)
    return cfg
