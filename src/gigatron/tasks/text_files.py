"""Task data files read as UTF-8 text: a file that cannot be read or is not UTF-8 is a clear
error naming the file and the line, never a traceback."""

from __future__ import annotations

from gigatron.errors import GigatronError


def read_utf8(path: str, what: str) -> str:
    """The whole text of `path`; `what` says what the file should be (for the message)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise GigatronError(f"{path}: cannot be read ({error.strerror}); give {what}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise GigatronError(
            f"{path}: line {line} is not UTF-8 text ({error.reason} at byte {error.start}); "
            f"give {what} in UTF-8"
        ) from None
