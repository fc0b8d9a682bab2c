"""Flags that gigatron parses (Megatron's scripts pass them) but whose feature is not built yet.

Each entry names a configuration field, the values that are refused and why; `validate_config`
reports every refused setting it finds, so no flag is accepted and then ignored. When the feature
lands, its code reads the field and the entry goes. tests/unit/test_flags.py checks that every
flag is either read by the code or listed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gigatron.config.fields import flag_name


@dataclass(frozen=True)
class Refusal:
    """`refused(value)` is True for the values that cannot work yet; `fix` says what to do."""

    refused: Callable[[Any], bool]
    fix: str


REFUSALS: dict[str, Refusal] = {
    "timing_log_level": Refusal(
        lambda value: value is not None and value > 1,
        "level 2 (fine-grained timers inside the schedule) is not available; use 1 for the "
        "forward-backward, optimizer and checkpoint timers",
    ),
}


def refused_settings(cfg: Any) -> list[str]:
    """One line per refused setting in `cfg` (a GigatronConfig: its sections are dataclasses)."""
    fields = {
        field.name: (section, field)
        for section in vars(cfg).values()
        if dataclasses.is_dataclass(section)
        for field in dataclasses.fields(section)
    }
    problems = []
    for name, refusal in REFUSALS.items():
        section, field = fields[name]
        value = getattr(section, name)
        if refusal.refused(value):
            shown = "" if isinstance(value, bool) else f" {value}"
            problems.append(f"{flag_name(field)}{shown}: {refusal.fix}")
    return problems
