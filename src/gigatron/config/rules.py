"""What every configuration section shares: its own cross-field rules as `problems()`.

A section's `problems()` checks only its own fields and returns one line per broken rule (the
flag, what is wrong, the fix); rules across sections live in config/validate.py, which collects
every line into one error.
"""

from __future__ import annotations

from collections.abc import Iterable


class Section:
    """Base of the configuration sections (dataclasses)."""

    def problems(self) -> list[str]:
        """One line per broken rule among this section's own fields (none by default)."""
        return []


def positive_problems(values: Iterable[tuple[int | float | None, str]]) -> list[str]:
    """'FLAG is V; it must be positive' for each (value, flag) whose value is given and <= 0."""
    return [
        f"{flag} is {value}; it must be positive"
        for value, flag in values
        if value is not None and value <= 0
    ]


def fraction_problem(value: float, flag: str, low_open: bool, high_open: bool) -> list[str]:
    """'FLAG V must lie in (0, 1)' style line when `value` is outside the interval."""
    above = value > 0.0 if low_open else value >= 0.0
    below = value < 1.0 if high_open else value <= 1.0
    if above and below:
        return []
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    return [f"{flag} {value} must lie in {interval}"]
