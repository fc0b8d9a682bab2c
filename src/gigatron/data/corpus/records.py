"""Streaming JSON-lines input and atomic output shared by the corpus tools.

Input errors name the file and line (non-UTF-8 bytes, malformed JSON, a missing key, an empty
file); outputs are written under a temporary name and renamed only when the tool succeeded, so a
failed or killed run never leaves a partial file where the output should be.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import IO, Any

from gigatron.data.json_lines import json_lines
from gigatron.errors import GigatronError

# Items (chunks of documents) queued per worker: enough to keep it busy, bounded for memory.
IN_FLIGHT_PER_WORKER = 4


def open_text(path: str) -> IO[bytes]:
    """The raw bytes of `path` (`.gz` decompressed), or a GigatronError naming it."""
    if not os.path.isfile(path):
        raise GigatronError(f"{path}: no such file; check the input path")
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def decode_line(raw: bytes, path: str, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise GigatronError(
            f"{path}: line {number} is not UTF-8 (byte {error.start}); re-encode the file "
            "as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def text_lines(stream: IO[bytes], path: str) -> Iterator[str]:
    """The lines of a byte stream as text (a UTF-8 error names the line; a BOM is dropped)."""
    for number, raw in enumerate(stream, 1):
        yield decode_line(raw, path, number).lstrip("\ufeff")


def read_records(path: str, key: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number from 1, record) of every non-blank line of a JSON-lines file; `key`, when
    given, must be a string field of every record."""
    count = 0
    with open_text(path) as stream:
        for number, record in json_lines(text_lines(stream, path), path):
            if not isinstance(record, dict):
                raise GigatronError(
                    f"{path}: line {number} is a JSON {type(record).__name__}, not an object; "
                    'give one object per line, e.g. {"text": "..."}'
                )
            if key is not None and not isinstance(record.get(key), str):
                present = ", ".join(list(record)[:8])
                raise GigatronError(
                    f"{path}: line {number} has no text field '{key}' (keys: {present}); "
                    "name the field with --json-key"
                )
            count += 1
            yield number, record
    if count == 0:
        raise GigatronError(f"{path}: holds no records; give a non-empty JSON-lines file")


def check_output(output: str, inputs: Iterable[str]) -> None:
    """Refuse an output that would overwrite an input or land in a missing folder."""
    target = os.path.abspath(output)
    for path in inputs:
        if os.path.exists(path) and os.path.abspath(path) == target:
            raise GigatronError(f"--output {output}: is also an input; write to another file")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise GigatronError(f"--output {output}: folder {folder} does not exist; create it")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[IO[str]]:
    """A text file written as `path` only if the block succeeds (renamed from a temporary)."""
    temporary = f"{path}.partial-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            yield stream
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


def write_record(stream: IO[str], record: dict[str, Any]) -> None:
    stream.write(json.dumps(record, ensure_ascii=False) + "\n")


def parallel_map(
    function: Callable[[Any], Any], items: Iterable[Any], workers: int
) -> Iterator[Any]:
    """`map(function, items)` in input order, over `workers` processes when more than one, with
    a bounded number of items in flight (memory stays flat; a dead worker raises, never hangs)."""
    if workers <= 1:
        yield from map(function, items)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
