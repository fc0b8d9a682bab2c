"""`gigatron preprocess`: JSON lines -> .bin/.idx datasets, with Megatron's preprocess_data flags.

The input is streamed: the main process reads chunks of raw lines, worker processes decode,
parse, split and batch-tokenize them, and the main process writes the results in input order.
At most a few chunks per worker are in flight, so memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import multiprocessing
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from gigatron.config.fields import add_dataclass_arguments
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.indexed import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from gigatron.data.sentences import SPLITTERS, sentence_splitter
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
    parser = argparse.ArgumentParser(
        allow_abbrev=False,  # Megatron refuses abbreviated flags too
        prog="gigatron preprocess",
        description="Tokenize loose JSON lines (one document per line) into indexed datasets "
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
        choices=sorted(SPLITTERS),
        help="language of the --split-sentences splitter (default: english)",
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
    if options.split_sentences:
        _worker["split"] = sentence_splitter(options.lang)


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

    # A document is empty when none of its keys has a token; empty ones are skipped (counted).
    nonempty = [False] * len(line_numbers)
    for k in range(len(keys)):
        position = 0
        for d, count in enumerate(counts[k]):
            if any(ids_per_key[k][position : position + count]):
                nonempty[d] = True
            position += count
    eod = tokenizer.eod if options.append_eod else None
    for _attempt in range(2):
        invalid_lines = {line for line, _ in result.invalid}
        keep = [
            nonempty[d] and line_numbers[d] not in invalid_lines for d in range(len(line_numbers))
        ]
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
            return result
        if not out_of_range:
            break
    for key_arrays in arrays.values():
        key_arrays.tokens = key_arrays.tokens.astype(options.dtype)
    result.arrays = arrays
    result.documents = sum(keep)
    invalid_lines = {line for line, _ in result.invalid}
    result.skipped_empty += sum(
        1
        for d in range(len(line_numbers))
        if not nonempty[d] and line_numbers[d] not in invalid_lines
    )
    return result


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


def _count_lines(files: Sequence[str]) -> int:
    """Lines in all files (a last line without its newline counts), reading in 4 MiB blocks."""
    total = 0
    for path in files:
        last = b""
        with open_input(path) as stream:
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
        with open_input(path) as stream:
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        raise GigatronError(f"--workers {args.workers}: must be at least 1")
    if args.partitions < 1:
        raise GigatronError(f"--partitions {args.partitions}: must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise GigatronError(f"--json-keys {' '.join(args.json_keys)}: keys repeat")
    tokenizer_cfg = _tokenizer_config(args)
    tokenizer = build_tokenizer(tokenizer_cfg)
    if args.append_eod and tokenizer.eod is None:
        raise GigatronError(
            f"--append-eod: {type(tokenizer).__name__} has no end-of-document token"
        )
    files = resolve_inputs(args.input)
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        os.makedirs(output_dir, exist_ok=True)  # like every later step, write into new folders
    except OSError as error:
        raise GigatronError(
            f"--output-prefix {args.output_prefix}: cannot create directory {output_dir} "
            f"({error.strerror}); give a writable location"
        ) from None
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
    )
    final_prefixes = _dataset_prefixes(args, level)
    partition_starts = partition_starts_for(files, args.partitions)
    partitions = len(partition_starts) + 1

    def partition_prefix(partition: int, key: str) -> str:
        if partitions == 1:
            return final_prefixes[key]
        return f"{args.output_prefix}_{partition}_{key}_{level}"

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
    builders: dict[str, IndexedDatasetBuilder] = {}
    finished_parts: list[str] = []
    current_partition = -1
    totals = {"documents": 0, "empty": 0, "invalid": 0}
    tokens = dict.fromkeys(args.json_keys, 0)
    sequences = dict.fromkeys(args.json_keys, 0)
    invalid_examples: list[str] = []
    pool = None

    def finish_partition() -> None:
        for key, builder in builders.items():
            prefix = partition_prefix(current_partition, key)
            builder.finalize(index_file_path(prefix))
            if partitions > 1:
                finished_parts.append(prefix)
        builders.clear()

    try:
        if args.workers > 1:
            fork = sys.platform == "linux"
            context = multiprocessing.get_context("fork" if fork else "spawn")
            # Under fork the workers inherit the parent's tokenizer instead of re-reading its
            # files (a GPT-2 vocabulary takes a noticeable fraction of a second to load).
            inherited = tokenizer if fork else None
            pool = context.Pool(
                args.workers, initializer=_init_worker, initargs=(options, inherited, True)
            )
            results = _ordered_map(pool, read_chunks(files, partition_starts), args.workers)
        else:
            _init_worker(options, tokenizer, in_subprocess=False)
            results = (
                (chunk, encode_chunk(chunk)) for chunk in read_chunks(files, partition_starts)
            )
        for chunk, result in results:
            path = files[chunk.file_index]
            if result.invalid:
                totals["invalid"] += len(result.invalid)
                result.invalid.sort()
                if not args.skip_invalid:
                    line_number, reason = result.invalid[0]
                    raise GigatronError(
                        f"{path}:{line_number}: {reason}; fix the line, or pass --skip-invalid "
                        "to skip bad lines"
                    )
                for line_number, reason in result.invalid:
                    if len(invalid_examples) < 10:
                        invalid_examples.append(f"{path}:{line_number}: {reason}")
            if chunk.partition != current_partition:
                if builders:
                    finish_partition()
                current_partition = chunk.partition
                for key in args.json_keys:
                    prefix = partition_prefix(current_partition, key)
                    builders[key] = IndexedDatasetBuilder(data_file_path(prefix), dtype)
            for key, arrays in result.arrays.items():
                builders[key].add_documents(
                    arrays.tokens, arrays.sequence_lengths, arrays.sequences_per_document
                )
                tokens[key] += int(arrays.tokens.size)
                sequences[key] += int(arrays.sequence_lengths.size)
            totals["documents"] += result.documents
            totals["empty"] += result.skipped_empty
            progress.update(result.documents + result.skipped_empty, result.bytes_read)
        if pool is not None:
            pool.close()
        if current_partition == -1:  # empty input: still write (empty) datasets
            current_partition = 0
            for key in args.json_keys:
                builders[key] = IndexedDatasetBuilder(
                    data_file_path(partition_prefix(0, key)), dtype
                )
        finish_partition()
        if partitions > 1:
            for key in args.json_keys:
                merged = IndexedDatasetBuilder(data_file_path(final_prefixes[key]), dtype)
                builders[key] = merged
                for part in range(partitions):
                    prefix = partition_prefix(part, key)
                    if os.path.exists(index_file_path(prefix)):
                        merged.add_index(prefix)
            for key, merged in builders.items():
                merged.finalize(index_file_path(final_prefixes[key]))
            builders.clear()
            _remove_datasets(finished_parts)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        _remove_datasets(finished_parts)
        if pool is not None:
            pool.terminate()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.join()

    elapsed = time.perf_counter() - start
    for line in invalid_examples:
        print(f"skipped {line}", file=sys.stderr)
    if totals["documents"] == 0:
        warnings.warn(
            f"--input {' '.join(args.input)}: no documents found ({totals['empty']} empty, "
            f"{totals['invalid']} invalid); the datasets written are empty and cannot be trained "
            "on",
            stacklevel=2,
        )
    input_bytes = progress.bytes
    print(f"documents:        {totals['documents']}")
    for key in args.json_keys:
        print(f"  {final_prefixes[key]}.bin/.idx: {sequences[key]} sequences, {tokens[key]} tokens")
    print(f"skipped empty:    {totals['empty']}")
    print(f"skipped invalid:  {totals['invalid']}")
    print(
        f"time:             {elapsed:.2f} s ({input_bytes / max(elapsed, 1e-9) / 1e6:.2f} MB/s, "
        f"{sum(tokens.values()) / max(elapsed, 1e-9):.0f} tokens/s)"
    )
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
