"""What a user reads on the terminal: warnings as one clean line each, written once per run.

Library code warns with `warnings.warn(...)` (so tests can catch it with `pytest.warns`); the
`gigatron` command shows every warning as `warning: <message>` instead of Python's
`file:line: UserWarning: ...` and the source line, and under torchrun only rank 0 shows them
(every rank runs the same code, so they would repeat once per process).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TextIO


def process_rank() -> int:
    """This process's global rank: torch.distributed's when initialised, else torchrun's RANK."""
    try:
        # why: torch loads only in commands that use it (gigatron --help stays fast)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def format_warning(message: Warning | str, category: type[Warning]) -> str:
    """`warning: <message>`; categories other than UserWarning are named."""
    text = str(message).strip()
    if category is UserWarning:
        return f"warning: {text}"
    return f"warning: {category.__name__}: {text}"


@contextlib.contextmanager
def one_line_warnings(stream: TextIO | None = None) -> Iterator[None]:
    """Show warnings as one line each on rank 0 (nothing on the other ranks) while inside."""
    previous = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if process_rank() != 0:
            return
        target = stream or file or sys.stderr
        print(format_warning(message, category), file=target, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous
