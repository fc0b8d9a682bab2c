"""Fields that only some model families use, and the one rule that refuses them elsewhere.

Each model family declares the configuration fields it accepts beyond the common core
(`ModelFamily.accepted_fields`): a field name (`encoder_num_layers`) or a field with one of its
values (`position_embedding_type=relative`) when only that value is family-specific. A field some
family claims is family-specific; one no family claims is core and accepted by every family. A
run of one family that sets a field it does not accept away from its default is refused, naming
the flag, the family and the families that use it: no flag is ever accepted and ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gigatron.config.fields import flag_name
from gigatron.config.root import SECTIONS, GigatronConfig, field_section


def _field(name: str) -> dataclasses.Field:
    (field,) = (f for f in dataclasses.fields(SECTIONS[field_section(name)]) if f.name == name)
    return field


def field_default(name: str) -> Any:
    """The dataclass default of configuration field `name`."""
    field = _field(name)
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def check_entry(entry: str) -> None:
    """Raise KeyError (a programming error in a family's declaration) for an unknown field."""
    field_section(entry.split("=", 1)[0])


def entry_is_set(cfg: GigatronConfig, entry: str) -> bool:
    """Whether `cfg` sets `name` away from its default, or `name=value` to that value."""
    name, _, value = entry.partition("=")
    current = getattr(getattr(cfg, field_section(name)), name)
    if value:
        return str(current) == value
    return current != field_default(name)


def entry_flag(entry: str) -> str:
    """'--encoder-num-layers', or '--position-embedding-type relative' for a valued entry."""
    name, _, value = entry.partition("=")
    flag = flag_name(_field(name))
    return f"{flag} {value}" if value else flag


def claims(families: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """{entry: the families (sorted) that accept it} from {family: its accepted entries}."""
    claimed: dict[str, list[str]] = {}
    for family in sorted(families):
        for entry in sorted(families[family]):
            check_entry(entry)
            claimed.setdefault(entry, []).append(family)
    return claimed


def foreign_settings(
    cfg: GigatronConfig,
    family: str,
    accepted: Iterable[str],
    claimed: Mapping[str, Sequence[str]],
) -> list[str]:
    """One line per family-specific setting of `cfg` that `family` does not accept."""
    accepted = set(accepted)
    problems = []
    for entry, owners in claimed.items():
        if entry in accepted or not entry_is_set(cfg, entry):
            continue
        users = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
        problems.append(
            f"{entry_flag(entry)}: the {family} family does not use it (only {users} "
            f"{'does' if len(owners) == 1 else 'do'}); remove it, or use "
            f"`gigatron pretrain {owners[0]}`"
        )
    return problems
