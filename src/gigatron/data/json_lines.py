"""Records of a JSON-lines text, numbered by line (SFT conversations, task files)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from gigatron.errors import GigatronError


def json_lines(lines: Iterable[str], path: str) -> Iterator[tuple[int, Any]]:
    """(line number from 1, record) of every non-blank line; a line that is not JSON is a
    GigatronError naming `path` and the line."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise GigatronError(f"{path}: line {number} is not JSON ({error})") from None
        yield number, record
