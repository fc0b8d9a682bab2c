"""Dataclass fields that know their command-line flag, and the argparse glue built from them.

Every configuration field is declared once with `flag_field`; the parser, the YAML loader and the
help text are all derived from that declaration, so adding a field adds its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from gigatron.errors import GigatronError


def flag_field(
    default: Any = None,
    help: str = "",
    *,
    flag: str | None = None,
    choices: list[Any] | None = None,
    store_false: bool = False,
    nargs: str | int | None = None,
    aliases: tuple[str, ...] = (),
    default_help: str | None = None,
) -> Any:
    """A dataclass field with its command-line flag.

    `flag` defaults to `--` + the field name with dashes. Booleans become store_true flags, or
    store_false ones with `store_false=True` (Megatron's `--disable-bias-linear` sets
    `add_bias_linear` to False). Lists take `nargs` values ("+" or "*" by default).
    `default_help` is what the help shows as the default when the field's default (often
    Megatron's None) stands for a value the code picks (e.g. `v2`).
    """
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "store_false": store_false,
        "nargs": nargs,
        "aliases": aliases,
        "default_help": default_help,
    }
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def off_switch(help: str, *, flag: str | None = None) -> Any:
    """A boolean on by default that its flag turns off: `--no-<name>` (Megatron's spelling), or
    `flag` where Megatron names it otherwise (`--disable-bias-linear`)."""
    field = flag_field(True, help, flag=flag, store_false=True)
    field.metadata = types.MappingProxyType({**field.metadata, "off_switch": True})
    return field


def flag_name(field: dataclasses.Field) -> str:
    prefix = "--no-" if field.metadata.get("off_switch") else "--"
    return field.metadata.get("flag") or prefix + field.name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one flag per field of dataclass `cls`; defaults are argparse.SUPPRESS so that only the
    flags a user typed show up in the namespace (YAML values and dataclass defaults stay intact)."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = field_types(cls)
    for field in dataclasses.fields(cls):
        if not field.metadata or field.metadata.get("flag") == "":
            continue
        tp, _ = _unwrap_optional(hints[field.name])
        names = [flag_name(field), *field.metadata.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if tp is bool:
            kwargs["action"] = "store_false" if field.metadata.get("store_false") else "store_true"
        else:
            origin = typing.get_origin(tp)
            if origin is list:
                (item_type,) = typing.get_args(tp)
                kwargs["type"] = item_type
                kwargs["nargs"] = field.metadata.get("nargs") or "+"
            else:
                kwargs["type"] = tp
                if field.metadata.get("nargs") is not None:
                    kwargs["nargs"] = field.metadata["nargs"]
            if field.metadata.get("choices"):
                kwargs["choices"] = field.metadata["choices"]
            shown = field.metadata.get("default_help") or default
            help_text = f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
        # argparse %-formats help text (%(default)s): a literal % (e.g. "i % N") must be doubled.
        kwargs["help"] = help_text.replace("%", "%%")
        group.add_argument(*names, **kwargs)


def coerce_value(cls: type, name: str, value: Any, source: str) -> Any:
    """Check and convert a value read from YAML for field `name` of `cls`."""

    hints = field_types(cls)
    tp, optional = _unwrap_optional(hints[name])
    if value is None:
        if optional:
            return None
        raise GigatronError(f"{source}: '{name}' may not be null; give a value or remove the key")
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if typing.get_origin(tp) is list:
            (item_type,) = typing.get_args(tp)
            items = value if isinstance(value, list) else str(value).split()
            return [item_type(v) for v in items]
        if tp is float and isinstance(value, (int, float, str)):
            return float(value)
        if tp is int and isinstance(value, (int, str)) and not isinstance(value, bool):
            return int(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        if tp in (bool, float, int, str) or typing.get_origin(tp) is list:
            raise GigatronError(f"{source}: '{name}' = {value!r} is not a valid {tp.__name__}")
        return value
    raise GigatronError(f"{source}: '{name}' = {value!r} is not a valid {getattr(tp, '__name__', tp)}")
