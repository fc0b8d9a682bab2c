"""`gigatron preprocess`: JSON lines -> .bin/.idx datasets, with Megatron's preprocess_data flags.

The input is streamed: the main process reads chunks of raw lines, worker processes decode,
parse, split and batch-tokenize them, and the main process writes the results in input order.
At most a few chunks per worker are in flight, so memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import json
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from gigatron.config.fields import add_dataclass_arguments
from gigatron.config.parser import command_parser
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.indexed import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from gigatron.data.sentences import TRAINING_CHARS, SentenceSplitter, sentence_splitter
from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError

# A chunk (the unit of work sent to a worker) closes at this many bytes or lines: big enough
# to amortise inter-process transfer and reach the tokenizer's batch speed, small enough to
# keep every worker busy and memory low.
CHUNK_BYTES = 1 << 18
CHUNK_LINES = 2048
# Chunks in flight per worker: enough to hide reading and writing, bounded for memory.
IN_FLIGHT_PER_WORKER = 4
INPUT_PATTERNS = ("*.jsonl", "*.json", "*.jsonl.gz", "*.json.gz")


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "preprocess",
        "Tokenize loose JSON lines (one document per line) into indexed datasets "
        "<output-prefix>_<key>_document.bin/.idx that `--data-path` reads.",
    )
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSON-lines file(s), glob patterns or directories; .gz files are decompressed",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to extract from each JSON line; one dataset per key (default: text)",
    )
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="one sequence per sentence (English rule-based splitter, no download)",
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences, keep the newlines that follow sentences",
    )
    group.add_argument(
        "--lang",
        default="english",
        help="language of the --split-sentences splitter: NLTK's punkt_tab model of that "
        "name when installed, else punkt trained on the input",
    )
    group.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip and count malformed lines (bad JSON, missing key, invalid UTF-8) "
        "instead of stopping at the first",
    )
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the outputs")
    group.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document token to documents"
    )
    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenizing processes (default: number of CPUs)",
    )
    group.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="write the output in this many contiguous parts, then merge them (same result; "
        "default: 1)",
    )
    group.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="documents between progress lines when stderr is not a terminal (default: 1000)",
    )
    add_dataclass_arguments(parser, TokenizerConfig, title="tokenizer")
    return parser


@dataclass
class Options:
    """What a worker needs to turn raw lines into token arrays."""

    tokenizer: TokenizerConfig
    json_keys: list[str]
    split_sentences: bool
    lang: str
    keep_newlines: bool
    append_eod: bool
    skip_invalid: bool
    dtype: str
    splitter: SentenceSplitter | None = None


@dataclass
class Chunk:
    file_index: int
    first_line: int  # 1-based line number of lines[0] in its file
    partition: int
    lines: list[bytes]


@dataclass
class KeyArrays:
    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray


@dataclass
class ChunkResult:
    arrays: dict[str, KeyArrays] = field(default_factory=dict)
    documents: int = 0
    skipped_empty: int = 0
    invalid: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    bytes_read: int = 0


# Each worker process builds its tokenizer once in the pool initializer; the pool API offers no
# other per-process place to keep it, hence this module-level slot (set only inside workers).
_worker: dict[str, Any] = {}


def _init_worker(options: Options, tokenizer: Any, in_subprocess: bool) -> None:
    """Set up a worker; `tokenizer` is the parent's (inherited, not pickled, under fork) or
    None to build one here."""

    if in_subprocess:
        # One tokenizing thread per worker process: the processes already fill the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
    _worker["options"] = options
    _worker["tokenizer"] = (
        tokenizer if tokenizer is not None else build_tokenizer(options.tokenizer)
    )
    if options.splitter is not None:
        _worker["split"] = options.splitter


def parse_line(raw: bytes, keys: Sequence[str]) -> tuple[list[list[str]] | None, str | None]:
    """The texts of each key (a list: one text, or pre-split sentences), or an error reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"invalid UTF-8 at byte {error.start}"
    if text.startswith("\ufeff"):  # a byte-order mark some editors put at the start of a file
        text = text[1:]
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return None, f"malformed JSON ({error.msg} at column {error.colno})"
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    values: list[list[str]] = []
    for key in keys:
        if key not in record:
            return None, f"missing key '{key}' (keys present: {', '.join(list(record)[:8])})"
        value = record[key]
        if isinstance(value, str):
            values.append([value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            values.append(value)
        else:
            return None, f"key '{key}' holds {type(value).__name__}, expected a string"
    return values, None


def encode_chunk(chunk: Chunk) -> ChunkResult:
    """Parse, split and tokenize one chunk of lines (runs in a worker)."""
    options: Options = _worker["options"]
    tokenizer = _worker["tokenizer"]
    split = _worker.get("split")
    keys = options.json_keys
    result = ChunkResult(bytes_read=sum(len(line) for line in chunk.lines))

    # texts[k] lists every sentence of key k, in order; counts[k][d] how many belong to doc d.
    texts: list[list[str]] = [[] for _ in keys]
    counts: list[list[int]] = [[] for _ in keys]
    line_numbers: list[int] = []
    for offset, raw in enumerate(chunk.lines):
        line_number = chunk.first_line + offset
        if not raw.strip():
            result.skipped_empty += 1
            continue
        values, reason = parse_line(raw, keys)
        if reason is not None:
            result.invalid.append((line_number, reason))
            if not options.skip_invalid:
                return result
            continue
        line_numbers.append(line_number)
        for k, pieces in enumerate(values):
            if split is not None:
                pieces = [s for piece in pieces for s in split(piece, options.keep_newlines)]
            texts[k].extend(pieces)
            counts[k].append(len(pieces))

    ids_per_key: list[list[list[int]]] = []
    for k in range(len(keys)):
        try:
            ids_per_key.append(tokenizer.tokenize_batch(texts[k]))
        except Exception:
            # Only tokenizers that can reject text (NullTokenizer) get here: find the culprits.
            ids_per_key.append(
                _tokenize_one_by_one(tokenizer, texts[k], counts[k], line_numbers, result)
            )

    nonempty = _nonempty_documents(ids_per_key, counts, len(line_numbers))
    arrays = _checked_arrays(
        options, tokenizer, ids_per_key, counts, line_numbers, nonempty, result
    )
    if arrays is None:
        return result
    for key_arrays in arrays.values():
        key_arrays.tokens = key_arrays.tokens.astype(options.dtype)
    result.arrays = arrays
    invalid_lines = {line for line, _ in result.invalid}
    for d, line_number in enumerate(line_numbers):
        if line_number not in invalid_lines:
            result.documents += int(nonempty[d])
            result.skipped_empty += int(not nonempty[d])
    return result


def _nonempty_documents(
    ids_per_key: list[list[list[int]]], counts: list[list[int]], documents: int
) -> list[bool]:
    """A document is empty when none of its keys has a token; empty ones are skipped."""
    nonempty = [False] * documents
    for ids, key_counts in zip(ids_per_key, counts):
        position = 0
        for d, count in enumerate(key_counts):
            if any(ids[position : position + count]):
                nonempty[d] = True
            position += count
    return nonempty


def _checked_arrays(
    options: Options,
    tokenizer: Any,
    ids_per_key: list[list[list[int]]],
    counts: list[list[int]],
    line_numbers: list[int],
    nonempty: list[bool],
    result: ChunkResult,
) -> dict[str, KeyArrays] | None:
    """Each key's arrays of the valid, non-empty documents; None when a line is invalid and
    invalid lines are not skipped. Token ids outside the vocabulary make their line invalid."""
    keys = options.json_keys
    eod = tokenizer.eod if options.append_eod else None
    for _attempt in range(2):
        invalid_lines = {line for line, _ in result.invalid}
        keep = [nonempty[d] and line not in invalid_lines for d, line in enumerate(line_numbers)]
        arrays = {
            key: _assemble(ids_per_key[k], counts[k], keep, eod) for k, key in enumerate(keys)
        }
        out_of_range = [
            k
            for k, key in enumerate(keys)
            if arrays[key].tokens.size
            and (
                int(arrays[key].tokens.min()) < 0
                or int(arrays[key].tokens.max()) >= tokenizer.vocab_size
            )
        ]
        # Only tokenizers that read ids from the text (NullTokenizer) find bad ids here.
        for k in out_of_range:
            _mark_out_of_range(
                ids_per_key[k], counts[k], line_numbers, tokenizer.vocab_size, result
            )
        if result.invalid and not options.skip_invalid:
            return None
        if not out_of_range:
            break
    return arrays


def _tokenize_one_by_one(
    tokenizer: Any,
    texts: list[str],
    counts: list[int],
    line_numbers: list[int],
    result: ChunkResult,
) -> list[list[int]]:
    ids: list[list[int]] = []
    for d, count in enumerate(counts):
        start = sum(counts[:d])
        for text in texts[start : start + count]:
            try:
                ids.append(tokenizer.tokenize(text))
            except Exception as error:
                result.invalid.append((line_numbers[d], f"cannot tokenize: {error}"))
                ids.append([])
    return ids


def _mark_out_of_range(
    ids: list[list[int]],
    counts: list[int],
    line_numbers: list[int],
    vocab_size: int,
    result: ChunkResult,
) -> None:
    position = 0
    for d, count in enumerate(counts):
        for sequence in ids[position : position + count]:
            if any(i < 0 or i >= vocab_size for i in sequence):
                result.invalid.append(
                    (line_numbers[d], f"token id outside the vocabulary [0, {vocab_size})")
                )
                break
        position += count


def _assemble(
    ids: list[list[int]], counts: list[int], keep: list[bool], eod: int | None
) -> KeyArrays:
    """Flatten one key's token lists into the arrays the index builder appends."""
    tokens: list[int] = []
    sequence_lengths: list[int] = []
    sequences_per_document: list[int] = []
    position = 0
    for d, count in enumerate(counts):
        sequences = ids[position : position + count]
        position += count
        if not keep[d]:
            continue
        nonempty = [s for s in sequences if s]
        for sequence in nonempty:
            tokens.extend(sequence)
            sequence_lengths.append(len(sequence))
        if nonempty and eod is not None:
            tokens.append(eod)
            sequence_lengths[-1] += 1
        sequences_per_document.append(len(nonempty))
    return KeyArrays(
        tokens=np.asarray(tokens, dtype=np.int64),
        sequence_lengths=np.asarray(sequence_lengths, dtype=np.int64),
        sequences_per_document=np.asarray(sequences_per_document, dtype=np.int64),
    )


def resolve_inputs(patterns: Sequence[str]) -> list[str]:
    """Expand files, globs and directories into a sorted, de-duplicated list of files."""
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(
                path
                for suffix in INPUT_PATTERNS
                for path in glob.glob(os.path.join(pattern, suffix))
            )
            if not found:
                raise GigatronError(
                    f"--input {pattern}: directory has no {', '.join(INPUT_PATTERNS)} files"
                )
        elif glob.has_magic(pattern):
            found = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
            if not found:
                raise GigatronError(f"--input {pattern}: the pattern matches no file")
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            raise GigatronError(f"--input {pattern}: file not found")
        files.extend(path for path in found if path not in files)
    return files


def open_input(path: str) -> BinaryIO:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


@contextlib.contextmanager
def reading(path: str) -> Iterator[BinaryIO]:
    """An input opened for reading; a truncated or corrupt .gz file, or one that cannot be read,
    is a clear error instead of a traceback."""
    try:
        with open_input(path) as stream:
            yield stream
    except (EOFError, zlib.error) as error:
        raise GigatronError(
            f"--input {path}: the compressed file is truncated or corrupt ({error}); "
            "download or compress it again"
        ) from None
    except gzip.BadGzipFile:
        raise GigatronError(
            f"--input {path}: not a gzip file although it ends in .gz; rename it or "
            "compress it with gzip"
        ) from None
    except OSError as error:
        raise GigatronError(f"--input {path}: cannot be read ({error})") from None


def training_text(files: Sequence[str], keys: Sequence[str]) -> str:
    """The texts at the start of the input (about TRAINING_CHARS characters), for training the
    sentence splitter; unreadable lines are skipped here (the main pass reports them)."""
    texts: list[str] = []
    size = 0
    for path in files:
        with reading(path) as stream:
            for raw in stream:
                values, _ = parse_line(raw, keys)
                for text in (t for pieces in values or [] for t in pieces):
                    texts.append(text)
                    size += len(text)
                if size >= TRAINING_CHARS:
                    return "\n\n".join(texts)
    return "\n\n".join(texts)


def write_splitter_record(writer: DatasetWriter, options: Options) -> None:
    """`<dataset>.json` beside each sentence dataset: which splitter made its sentences."""
    for prefix in writer.final.values():
        record = {"sentence_splitter": options.splitter.description, "lang": options.lang,
                  "keep_newlines": options.keep_newlines}  # fmt: skip
        temporary = f"{prefix}.json.partial-{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as stream:
            json.dump(record, stream, indent=1)
        os.replace(temporary, f"{prefix}.json")


def _count_lines(files: Sequence[str]) -> int:
    """Lines in all files (a last line without its newline counts), reading in 4 MiB blocks."""
    total = 0
    for path in files:
        last = b""
        with reading(path) as stream:
            for block in iter(lambda stream=stream: stream.read(1 << 22), b""):
                total += block.count(b"\n")
                last = block
        if last and not last.endswith(b"\n"):
            total += 1
    return total


def read_chunks(files: Sequence[str], partition_starts: Sequence[int]) -> Iterator[Chunk]:
    """Chunks of raw lines in input order; a chunk never spans two files or two partitions.

    `partition_starts[i]` is the global line index where partition i + 1 begins.
    """
    global_line = 0
    partition = 0
    for file_index, path in enumerate(files):
        with reading(path) as stream:
            lines: list[bytes] = []
            size = 0
            first_line = 1
            for line_number, raw in enumerate(stream, start=1):
                at_boundary = (
                    partition < len(partition_starts) and global_line == partition_starts[partition]
                )
                if lines and (at_boundary or size >= CHUNK_BYTES or len(lines) >= CHUNK_LINES):
                    yield Chunk(file_index, first_line, partition, lines)
                    lines, size, first_line = [], 0, line_number
                if at_boundary:
                    partition += 1
                if not lines:
                    first_line = line_number
                lines.append(raw)
                size += len(raw)
                global_line += 1
            if lines:
                yield Chunk(file_index, first_line, partition, lines)


def partition_starts_for(files: Sequence[str], partitions: int) -> list[int]:
    if partitions <= 1:
        return []
    total = _count_lines(files)
    return [total * i // partitions for i in range(1, partitions)]


class Progress:
    """A tqdm bar on a terminal, else a line every `log_interval` documents (batch logs)."""

    def __init__(self, total_bytes: int | None, log_interval: int) -> None:
        self.start = time.perf_counter()
        self.documents = 0
        self.bytes = 0
        self.log_interval = max(1, log_interval)
        self._next_log = self.log_interval
        self._bar = None
        if sys.stderr.isatty():
            # why: tqdm loads only for a terminal's progress bar
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="preprocess"
            )

    def update(self, documents: int, num_bytes: int) -> None:
        self.documents += documents
        self.bytes += num_bytes
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        if self._bar is not None:
            self._bar.update(num_bytes)
            self._bar.set_postfix(docs=self.documents, docs_s=f"{self.documents / elapsed:.0f}")
        elif self.documents >= self._next_log:
            self._next_log = (self.documents // self.log_interval + 1) * self.log_interval
            print(
                f"processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TokenizerConfig)
        if hasattr(args, f.name)
    }
    return TokenizerConfig(**values)


def _dataset_prefixes(args: argparse.Namespace, level: str) -> dict[str, str]:
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise GigatronError(f"--workers {args.workers}: must be at least 1")
    if args.partitions < 1:
        raise GigatronError(f"--partitions {args.partitions}: must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise GigatronError(f"--json-keys {' '.join(args.json_keys)}: keys repeat")


def prepare_output_dir(output_prefix: str) -> None:
    """Create the output folder and check that files can be written there, before any work."""
    output_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(output_dir, exist_ok=True)  # like every later step, write into new folders
        probe = tempfile.NamedTemporaryFile(dir=output_dir, prefix=".gigatron-probe-")
        probe.close()
    except OSError as error:
        raise GigatronError(
            f"--output-prefix {output_prefix}: cannot write in {output_dir} "
            f"({error.strerror}); give a writable location"
        ) from None


class DatasetWriter:
    """The builders of every key, one partition at a time; the partitions are merged into the
    final datasets at the end (and removed)."""

    def __init__(self, args: argparse.Namespace, level: str, dtype: Any, partitions: int) -> None:
        self.args, self.level, self.dtype, self.partitions = args, level, dtype, partitions
        self.final = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
        self.builders: dict[str, Any] = {}
        self.finished_parts: list[str] = []
        self.current = -1
        self.tokens = dict.fromkeys(args.json_keys, 0)
        self.sequences = dict.fromkeys(args.json_keys, 0)

    def prefix(self, partition: int, key: str) -> str:
        if self.partitions == 1:
            return self.final[key]
        return f"{self.args.output_prefix}_{partition}_{key}_{self.level}"

    def _start(self, partition: int) -> None:

        if self.builders:
            self._finish_partition()
        self.current = partition
        for key in self.args.json_keys:
            path = data_file_path(self.prefix(partition, key))
            self.builders[key] = IndexedDatasetBuilder(path, self.dtype)

    def _finish_partition(self) -> None:

        for key, builder in self.builders.items():
            prefix = self.prefix(self.current, key)
            builder.finalize(index_file_path(prefix))
            if self.partitions > 1:
                self.finished_parts.append(prefix)
        self.builders.clear()

    def add(self, chunk: Chunk, result: ChunkResult) -> None:
        if chunk.partition != self.current:
            self._start(chunk.partition)
        for key, arrays in result.arrays.items():
            self.builders[key].add_documents(
                arrays.tokens, arrays.sequence_lengths, arrays.sequences_per_document
            )
            self.tokens[key] += int(arrays.tokens.size)
            self.sequences[key] += int(arrays.sequence_lengths.size)

    def finish(self) -> None:

        if self.current == -1:  # empty input: still write (empty) datasets
            self._start(0)
        self._finish_partition()
        if self.partitions == 1:
            return
        for key in self.args.json_keys:
            merged = IndexedDatasetBuilder(data_file_path(self.final[key]), self.dtype)
            self.builders[key] = merged
            for part in range(self.partitions):
                prefix = self.prefix(part, key)
                if os.path.exists(index_file_path(prefix)):
                    merged.add_index(prefix)
        for key, merged in self.builders.items():
            merged.finalize(index_file_path(self.final[key]))
        self.builders.clear()
        _remove_datasets(self.finished_parts)

    def abort(self) -> None:
        for builder in self.builders.values():
            builder.abort()
        _remove_datasets(self.finished_parts)


@dataclass
class Totals:
    documents: int = 0
    empty: int = 0
    invalid: int = 0
    examples: list[str] = field(default_factory=list)  # the first skipped lines, for the report

    def count(self, path: str, result: ChunkResult, skip_invalid: bool) -> None:
        if result.invalid:
            self.invalid += len(result.invalid)
            result.invalid.sort()
            if not skip_invalid:
                line_number, reason = result.invalid[0]
                raise GigatronError(
                    f"{path}:{line_number}: {reason}; fix the line, or pass --skip-invalid "
                    "to skip bad lines"
                )
            for line_number, reason in result.invalid:
                if len(self.examples) < 10:
                    self.examples.append(f"{path}:{line_number}: {reason}")
        self.documents += result.documents
        self.empty += result.skipped_empty


def _encoded_chunks(
    args: argparse.Namespace, options: Options, tokenizer: Any, files: Sequence[str], pool: Any
) -> Iterator[tuple[Chunk, ChunkResult]]:
    partition_starts = partition_starts_for(files, args.partitions)
    if pool is not None:
        return _ordered_map(pool, read_chunks(files, partition_starts), args.workers)
    _init_worker(options, tokenizer, in_subprocess=False)
    return ((chunk, encode_chunk(chunk)) for chunk in read_chunks(files, partition_starts))


def _start_pool(args: argparse.Namespace, options: Options, tokenizer: Any) -> Any:
    if args.workers == 1:
        return None
    fork = sys.platform == "linux"
    context = multiprocessing.get_context("fork" if fork else "spawn")
    # Under fork the workers inherit the parent's tokenizer instead of re-reading its files (a
    # GPT-2 vocabulary takes a noticeable fraction of a second to load).
    inherited = tokenizer if fork else None
    return context.Pool(args.workers, initializer=_init_worker, initargs=(options, inherited, True))


def _run(
    args: argparse.Namespace,
    options: Options,
    tokenizer: Any,
    files: Sequence[str],
    writer: DatasetWriter,
    progress: Progress,
) -> Totals:
    totals = Totals()
    pool = _start_pool(args, options, tokenizer)
    try:
        for chunk, result in _encoded_chunks(args, options, tokenizer, files, pool):
            totals.count(files[chunk.file_index], result, args.skip_invalid)
            writer.add(chunk, result)
            progress.update(result.documents + result.skipped_empty, result.bytes_read)
        if pool is not None:
            pool.close()
        writer.finish()
    except BaseException:
        writer.abort()
        if pool is not None:
            pool.terminate()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.join()
    return totals


def _report(
    args: argparse.Namespace,
    totals: Totals,
    writer: DatasetWriter,
    elapsed: float,
    input_bytes: int,
) -> None:
    for line in totals.examples:
        print(f"skipped {line}", file=sys.stderr)
    if totals.documents == 0:
        warnings.warn(
            f"--input {' '.join(args.input)}: no documents found ({totals.empty} empty, "
            f"{totals.invalid} invalid); the datasets written are empty and cannot be trained "
            "on",
            stacklevel=3,
        )
    print(f"documents:        {totals.documents}")
    for key in args.json_keys:
        print(
            f"  {writer.final[key]}.bin/.idx: {writer.sequences[key]} sequences, "
            f"{writer.tokens[key]} tokens"
        )
    print(f"skipped empty:    {totals.empty}")
    print(f"skipped invalid:  {totals.invalid}")
    print(
        f"time:             {elapsed:.2f} s ({input_bytes / max(elapsed, 1e-9) / 1e6:.2f} MB/s, "
        f"{sum(writer.tokens.values()) / max(elapsed, 1e-9):.0f} tokens/s)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    from gigatron.data.tokenizers import build_tokenizer

    args = build_parser().parse_args(argv)
    _check_args(args)
    tokenizer_cfg = _tokenizer_config(args)
    tokenizer = build_tokenizer(tokenizer_cfg)
    if args.append_eod and tokenizer.eod is None:
        raise GigatronError(
            f"--append-eod: {type(tokenizer).__name__} has no end-of-document token"
        )
    files = resolve_inputs(args.input)
    prepare_output_dir(args.output_prefix)
    dtype = optimal_dtype(tokenizer.vocab_size)
    level = "sentence" if args.split_sentences else "document"
    options = Options(
        tokenizer=tokenizer_cfg,
        json_keys=list(args.json_keys),
        split_sentences=args.split_sentences,
        lang=args.lang,
        keep_newlines=args.keep_newlines,
        append_eod=args.append_eod,
        skip_invalid=args.skip_invalid,
        dtype=dtype.str,
        splitter=(
            sentence_splitter(args.lang, training_text(files, args.json_keys))
            if args.split_sentences
            else None
        ),
    )
    writer = DatasetWriter(args, level, dtype, args.partitions)
    any_gz = any(path.endswith(".gz") for path in files)
    progress = Progress(
        None if any_gz else sum(os.path.getsize(p) for p in files), args.log_interval
    )
    backend = getattr(tokenizer, "backend", None)
    print(
        f"preprocess: {len(files)} input file(s), tokenizer {type(tokenizer).__name__} "
        f"(vocab {tokenizer.vocab_size}, token dtype {dtype}"
        f"{f', encoded by {backend}' if backend else ''}), {args.workers} worker(s)",
        file=sys.stderr,
    )
    start = time.perf_counter()
    totals = _run(args, options, tokenizer, files, writer, progress)
    if options.splitter is not None:
        write_splitter_record(writer, options)
        print(f"sentences split by {options.splitter.description}", file=sys.stderr)
    _report(args, totals, writer, time.perf_counter() - start, progress.bytes)
    return 0


def _ordered_map(
    pool: Any, chunks: Iterator[Chunk], workers: int
) -> Iterator[tuple[Chunk, ChunkResult]]:
    """Results in input order with a bounded number of chunks in flight.

    `Pool.imap` would drain the whole input iterator into its task queue (no back-pressure);
    this keeps at most IN_FLIGHT_PER_WORKER chunks per worker outstanding.
    """
    pending: deque[tuple[Chunk, Any]] = deque()
    limit = workers * IN_FLIGHT_PER_WORKER
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(encode_chunk, (chunk,))))
        if len(pending) >= limit:
            done_chunk, future = pending.popleft()
            yield done_chunk, future.get()
    while pending:
        done_chunk, future = pending.popleft()
        yield done_chunk, future.get()


def _remove_datasets(prefixes: Sequence[str]) -> None:
    for prefix in prefixes:
        for extension in (".bin", ".idx"):
            try:
                os.remove(prefix + extension)
            except FileNotFoundError:
                pass
