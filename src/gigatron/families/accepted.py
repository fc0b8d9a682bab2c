"""Checking a configuration against one family: the generic refusal of fields only other
families use (their `accepted_fields`), then the family's own rules (`validate`)."""

from __future__ import annotations

from typing import Any

from gigatron.config.family_fields import claims, foreign_settings
from gigatron.errors import GigatronError
from gigatron.families.registry import ModelFamily, family_names, get_family


def claimed_fields() -> dict[str, list[str]]:
    """{field entry: the registered families that accept it}."""
    return claims({name: get_family(name).accepted_fields for name in family_names()})


def refuse_foreign_fields(family: ModelFamily, cfg: Any) -> None:
    """GigatronError naming each flag that only other families use, when `cfg` sets it."""
    problems = foreign_settings(cfg, family.name, family.accepted_fields, claimed_fields())
    if problems:
        raise GigatronError("\n".join(problems))


def check_family_config(family: ModelFamily, cfg: Any) -> None:
    """Every rule of `family` on a finalized, validated `cfg` (the command's edge calls it)."""
    refuse_foreign_fields(family, cfg)
    if family.validate is not None:
        family.validate(cfg)
