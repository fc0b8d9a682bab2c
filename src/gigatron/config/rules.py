"""What every configuration section shares: its own cross-field rules as `problems()`.

A section's `problems()` checks only its own fields and returns one line per broken rule (the
flag, what is wrong, the fix); rules across sections live in config/validate.py, which collects
every line into one error.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any


class Section:
    """Base of the configuration sections (dataclasses): their own rules (`problems`), and
    freezing once validated (`freeze`: any later assignment raises; a deep copy is unfrozen)."""

    _frozen = False  # a class attribute, not a dataclass field

    def problems(self) -> list[str]:
        """One line per broken rule among this section's own fields (none by default)."""
        return []

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name}: the configuration is frozen once validated at the "
                "command's edge; set it before freeze_config, or change a copy.deepcopy of it"
            )
        super().__setattr__(name, value)

    def __deepcopy__(self, memo: dict) -> Section:
        copied = object.__new__(type(self))
        for name, value in self.__dict__.items():
            if name != "_frozen":
                object.__setattr__(copied, name, copy.deepcopy(value, memo))
        return copied


def positive_problems(values: Iterable[tuple[int | float | None, str]]) -> list[str]:
    """'FLAG is V; it must be positive' for each (value, flag) whose value is given and <= 0."""
    return [f"{flag} is {value}; it must be positive" for value, flag in values if value is not None and value <= 0]


def fraction_problem(value: float, flag: str, low_open: bool, high_open: bool) -> list[str]:
    """'FLAG V must lie in (0, 1)' style line when `value` is outside the interval."""
    above = value > 0.0 if low_open else value >= 0.0
    below = value < 1.0 if high_open else value <= 1.0
    if above and below:
        return []
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    return [f"{flag} {value} must lie in {interval}"]
