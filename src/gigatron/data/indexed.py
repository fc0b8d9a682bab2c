"""The indexed dataset: a `.bin` file of token ids and a `.idx` file that says where each sequence
starts, byte-compatible with Megatron-Core's MMIDIDX format (see docs/data.md for the layout).

Written by hand because no maintained library reads this format; numpy memory maps do the I/O,
so opening a dataset costs no more than reading its header.
"""

from __future__ import annotations

import difflib
import mmap
import os
import shutil
import struct
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gigatron.errors import GigatronError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document-index count (8)
HEADER_SIZE = 34

DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}

PathLike = str | os.PathLike


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """The token dtype preprocessing uses: uint16 below a vocabulary of 65,500, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype: Any) -> int:
    """The .idx code of a numpy dtype; GigatronError for a dtype the format cannot hold."""
    normalized = np.dtype(dtype).newbyteorder("=")
    if normalized not in CODE_BY_DTYPE:
        supported = ", ".join(str(d) for d in DTYPE_BY_CODE.values())
        raise GigatronError(
            f"token dtype {normalized}: not storable in an indexed dataset; use one of {supported}"
        )
    return CODE_BY_DTYPE[normalized]


def data_file_path(prefix: PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def index_file_path(prefix: PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def missing_files(prefix: PathLike) -> list[str]:
    """Which of PREFIX.bin and PREFIX.idx do not exist (as paths)."""
    paths = (data_file_path(prefix), index_file_path(prefix))
    return [path for path in paths if not os.path.isfile(path)]


def existing_prefix_like(prefix: PathLike) -> str | None:
    """The prefix of a dataset (both .bin and .idx present) in `prefix`'s directory that the user
    most likely meant: one that extends it (`data/corpus` -> `data/corpus_text_document`), else
    the closest name; None when the directory holds no dataset."""
    directory, name = os.path.split(os.fspath(prefix))
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return None
    stems = sorted(
        entry[: -len(".bin")]
        for entry in entries
        if entry.endswith(".bin") and f"{entry[: -len('.bin')]}.idx" in entries
    )
    for stem in (name, name.removesuffix(".bin"), name.removesuffix(".idx")):
        extending = [s for s in stems if s.startswith(stem) and s != name]
        if extending:
            return os.path.join(directory, extending[0])
    close = difflib.get_close_matches(name, stems, n=1, cutoff=0.6)
    return os.path.join(directory, close[0]) if close else None


def missing_dataset_hint(prefix: PathLike) -> str:
    """'; did you mean PREFIX2?' when a dataset with a similar prefix exists, else ''."""
    found = existing_prefix_like(prefix)
    return f"; did you mean {found}?" if found else ""


def require_dataset(prefix: PathLike) -> None:
    """GigatronError naming PREFIX.bin / PREFIX.idx when either is missing."""
    missing = missing_files(prefix)
    if missing:
        raise GigatronError(
            f"{' and '.join(missing)}: not found; give the dataset prefix without extension "
            f"(PREFIX for PREFIX.bin and PREFIX.idx){missing_dataset_hint(prefix)}"
        )


def dataset_exists(prefix: PathLike) -> bool:
    """True when both PREFIX.bin and PREFIX.idx exist."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def _temporary_path(path: str) -> str:
    # Same directory as the target so that the final os.replace is an atomic rename.
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}.tmp")


class DocumentTable:
    """`len()` (sequences), `sequence_lengths` and `document_indices` of a low-level dataset,
    read from its `_sequence_lengths` and `_document_indices` arrays."""

    _sequence_lengths: np.ndarray
    _document_indices: np.ndarray

    def __len__(self) -> int:
        return len(self._sequence_lengths)

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self._document_indices


class IndexedDataset(DocumentTable):
    """A read-only, memory-mapped .bin/.idx pair.

    `multimodal=True` reads the trailing per-sequence modes array (the .idx header has no flag
    for it; the caller has to know, as in Megatron-Core).
    """

    def __init__(self, prefix: PathLike, multimodal: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.multimodal = multimodal
        self._open()

    # A memmap pickles as a full copy of its data; data-loader workers re-open the files instead.
    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "multimodal": self.multimodal}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix = state["prefix"]
        self.multimodal = state["multimodal"]
        self._open()

    def _open(self) -> None:
        idx_path = index_file_path(self.prefix)
        sequence_count, document_count = self._read_header(idx_path)

        self._idx_map = _map_file(idx_path)
        self._mapped_sizes = [(idx_path, self._idx_map, os.path.getsize(idx_path))]

        def view(dtype: str, count: int, offset: int) -> np.ndarray:
            if count == 0:
                return np.zeros(0, dtype=dtype)
            return np.frombuffer(self._idx_map, dtype=dtype, count=count, offset=offset)

        offset = HEADER_SIZE
        self._sequence_lengths = view("<i4", sequence_count, offset)
        offset += 4 * sequence_count
        self._sequence_pointers = view("<i8", sequence_count, offset)
        offset += 8 * sequence_count
        self._document_indices = view("<i8", document_count, offset)
        offset += 8 * document_count
        self._sequence_modes = view("<i1", sequence_count, offset) if self.multimodal else None
        self._check_and_map_tokens(idx_path, sequence_count)

    def _read_header(self, idx_path: str) -> tuple[int, int]:
        """(sequence count, document count) of a checked index header; sets the token dtype."""
        require_dataset(self.prefix)
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_SIZE:
            raise GigatronError(
                f"{idx_path}: truncated index ({idx_size} bytes, the header alone is "
                f"{HEADER_SIZE}); regenerate the dataset with `gigatron preprocess`"
            )
        with open(idx_path, "rb") as stream:
            header = stream.read(HEADER_SIZE)
        magic = header[:9]
        if magic != MAGIC:
            raise GigatronError(
                f"{idx_path}: not an indexed dataset index (magic {magic!r}, expected {MAGIC!r}); "
                "only Megatron-Core's MMIDIDX format is supported"
            )
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise GigatronError(
                f"{idx_path}: index version {version} is not supported (expected {VERSION})"
            )
        code = header[17]
        if code not in DTYPE_BY_CODE:
            raise GigatronError(
                f"{idx_path}: unknown token dtype code {code} (valid codes are 1..8); "
                "the file is corrupt"
            )
        self._dtype = DTYPE_BY_CODE[code]
        sequence_count, document_count = struct.unpack("<QQ", header[18:34])
        expected_size = HEADER_SIZE + 12 * sequence_count + 8 * document_count
        if self.multimodal:
            expected_size += sequence_count
        if idx_size != expected_size:
            raise GigatronError(
                f"{idx_path}: size {idx_size} bytes does not match its header "
                f"({sequence_count} sequences, {document_count} document indices -> "
                f"{expected_size} bytes"
                + ("" if self.multimodal else "; a multimodal index needs multimodal=True")
                + "); the file is truncated or corrupt"
            )
        if document_count < 1:
            raise GigatronError(f"{idx_path}: empty document index; the file is corrupt")

        return sequence_count, document_count

    def _check_and_map_tokens(self, idx_path: str, sequence_count: int) -> None:
        """Check the index against the data file, then map the tokens."""
        bin_path = data_file_path(self.prefix)
        if self._document_indices[0] != 0 or self._document_indices[-1] != sequence_count:
            raise GigatronError(
                f"{idx_path}: document indices run from {int(self._document_indices[0])} to "
                f"{int(self._document_indices[-1])}, expected 0 to the sequence count "
                f"{sequence_count}; the file is corrupt"
            )
        bin_size = os.path.getsize(bin_path)
        itemsize = self._dtype.itemsize
        total_tokens = int(self._sequence_lengths.sum(dtype=np.int64))
        if total_tokens * itemsize != bin_size:
            raise GigatronError(
                f"{bin_path}: size {bin_size} bytes does not match its index {idx_path} "
                f"({total_tokens} tokens of {self._dtype} = {total_tokens * itemsize} bytes); "
                "the pair is truncated or from different runs, regenerate it"
            )
        if sequence_count:
            last_end = int(self._sequence_pointers[-1]) + int(self._sequence_lengths[-1]) * itemsize
            if int(self._sequence_pointers[0]) != 0 or last_end != bin_size:
                raise GigatronError(
                    f"{idx_path}: sequence pointers do not cover {bin_path} "
                    f"(first {int(self._sequence_pointers[0])}, last sequence ends at "
                    f"{last_end}, file has {bin_size} bytes); the index is corrupt"
                )
        if bin_size == 0:
            self._tokens = np.zeros(0, dtype=self._dtype.newbyteorder("<"))
        else:
            bin_map = _map_file(bin_path)
            self._mapped_sizes.append((bin_path, bin_map, bin_size))
            self._tokens = np.frombuffer(bin_map, dtype=self._dtype.newbyteorder("<"))

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._sequence_pointers

    @property
    def sequence_modes(self) -> np.ndarray | None:
        return self._sequence_modes

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def _check_index(self, index: int) -> int:
        count = len(self)
        if not -count <= index < count:
            raise IndexError(
                f"sequence {index} out of range for {count} sequences in {self.prefix}"
            )
        return index % count

    def _check_files_unchanged(self) -> None:
        """Stop with the file's name when a mapped file changed size since it was opened: reading
        a truncated map would kill the process (SIGBUS) instead of raising an error."""
        for path, mapping, size in self._mapped_sizes:
            current = mapping.size()  # one fstat of the map's own descriptor
            if current != size:
                raise GigatronError(
                    f"{path}: its size changed from {size} to {current} bytes while the run "
                    "was reading it (truncated or rewritten in place); restore the file, then "
                    "resume from the last checkpoint with --load"
                )

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `index` (to its end when length is None)."""
        self._check_files_unchanged()
        index = self._check_index(int(index))
        sequence_length = int(self._sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {index} "
                f"of length {sequence_length} in {self.prefix}"
            )
        start = int(self._sequence_pointers[index]) // self._dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return [self.get(i) for i in range(start, stop, step)]
        if isinstance(index, (int, np.integer)):
            return self.get(int(index))
        raise TypeError(f"indexed dataset index must be an int or a slice, not {type(index)}")

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, "
            f"documents={len(self._document_indices) - 1}, dtype={self._dtype})"
        )


class IndexedDatasetBuilder:
    """Writes a .bin/.idx pair; nothing appears under the final names until `finalize`.

    The .bin is streamed to a temporary file next to `bin_path`; `finalize(idx_path)` writes the
    index the same way and then renames both. Use as a context manager (or call `abort()`) so
    that an error removes the temporary files.
    """

    def __init__(self, bin_path: PathLike, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.bin_path = os.fspath(bin_path)
        self.dtype = np.dtype(dtype).newbyteorder("=")
        self._code = dtype_code(self.dtype)
        self.multimodal = multimodal
        self._tmp_bin_path = _temporary_path(self.bin_path)
        Path(self.bin_path).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp_bin_path, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._sequence_lengths = array("q")
        self._document_indices = array("q", [0])
        self._sequence_modes = array("b") if multimodal else None

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is not None or not self._bin.closed:
            self.abort()

    @property
    def num_sequences(self) -> int:
        return len(self._sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        if hasattr(tokens, "detach"):  # a torch tensor
            tokens = tokens.detach().cpu().numpy()
        values = np.asarray(tokens)
        if values.dtype == self.dtype:
            return values.reshape(-1)
        if values.size and np.issubdtype(self.dtype, np.integer):
            if not np.issubdtype(values.dtype, np.integer):
                raise GigatronError(
                    f"{self.bin_path}: token values of dtype {values.dtype} cannot be stored as "
                    f"{self.dtype}"
                )
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise GigatronError(
                    f"{self.bin_path}: token id range [{low}, {high}] does not fit {self.dtype}; "
                    "use a wider dtype (int32 for vocabularies of 65,500 or more)"
                )
        return values.astype(self.dtype).reshape(-1)

    def _write(self, values: np.ndarray) -> None:
        self._bin.write(values.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (not yet closing a document)."""
        values = self._as_tokens(tokens)
        self._write(values)
        self._sequence_lengths.append(values.size)
        if self._sequence_modes is not None:
            self._sequence_modes.append(mode)

    def add_document(
        self, tokens: Any, lengths: Sequence[int], modes: Sequence[int] | None = None
    ) -> None:
        """Append a document: `tokens` is its sequences concatenated, `lengths` their sizes."""
        values = self._as_tokens(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != values.size or any(n < 0 for n in lengths):
            raise ValueError(
                f"add_document: lengths {lengths[:8]}... sum to {sum(lengths)}, "
                f"but {values.size} tokens were given"
            )
        self._write(values)
        self._sequence_lengths.extend(lengths)
        if self._sequence_modes is not None:
            self._sequence_modes.extend(modes if modes is not None else [0] * len(lengths))
        self._document_indices.append(len(self._sequence_lengths))

    def add_documents(
        self, tokens: Any, sequence_lengths: Any, sequences_per_document: Any
    ) -> None:
        """Append many documents at once: `tokens` holds all their sequences concatenated,
        `sequence_lengths` the size of each sequence, `sequences_per_document` how many sequences
        each document has (0 for an empty document). One write instead of one per document."""
        values = self._as_tokens(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != values.size or int(counts.sum()) != lengths.size:
            raise ValueError(
                f"add_documents: {values.size} tokens, lengths summing to {int(lengths.sum())}, "
                f"{lengths.size} sequences but documents counting {int(counts.sum())}"
            )
        if self._sequence_modes is not None:
            self._sequence_modes.frombytes(np.zeros(lengths.size, dtype=np.int8).tobytes())
        self._write(values)
        offset = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(lengths.tobytes())
        self._document_indices.frombytes((np.cumsum(counts) + offset).astype(np.int64).tobytes())

    def end_document(self) -> None:
        """Close the current document after sequences appended with `add_item`."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_index(self, prefix: PathLike) -> None:
        """Append a whole existing dataset (same dtype): its sequences and documents follow ours."""
        other = IndexedDataset(prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise GigatronError(
                f"{index_file_path(prefix)}: token dtype {other.dtype} differs from {self.dtype} "
                f"of the dataset being built ({self.bin_path}); merge only datasets made with "
                "the same tokenizer"
            )
        offset = len(self._sequence_lengths)
        # Bulk byte copies: a merged corpus can hold hundreds of millions of sequences.
        self._sequence_lengths.frombytes(other.sequence_lengths.astype(np.int64).tobytes())
        self._document_indices.frombytes(
            (other.document_indices[1:].astype(np.int64) + offset).tobytes()
        )
        if self._sequence_modes is not None and other.sequence_modes is not None:
            self._sequence_modes.extend(other.sequence_modes.tolist())
        self._bin.flush()
        with open(data_file_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=16 * 1024 * 1024)
        del other

    def finalize(self, idx_path: PathLike) -> None:
        """Write the index and move both files to their final names."""
        idx_path = os.fspath(idx_path)
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            self.abort()
            raise GigatronError(
                f"{idx_path}: a sequence of {int(lengths.max())} tokens exceeds the format's "
                "int32 length; split the document into sentences or smaller pieces"
            )
        pointers = np.zeros(lengths.size, dtype="<i8")
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.frombuffer(self._document_indices, dtype=np.int64)
        tmp_idx_path = _temporary_path(idx_path)
        try:
            self._bin.close()
            with open(tmp_idx_path, "wb") as stream:
                stream.write(MAGIC)
                stream.write(struct.pack("<Q", VERSION))
                stream.write(struct.pack("<B", self._code))
                stream.write(struct.pack("<Q", lengths.size))
                stream.write(struct.pack("<Q", document_indices.size))
                stream.write(lengths.astype("<i4").tobytes(order="C"))
                stream.write(pointers.tobytes(order="C"))
                stream.write(document_indices.astype("<i8").tobytes(order="C"))
                if self._sequence_modes is not None:
                    stream.write(np.frombuffer(self._sequence_modes, dtype=np.int8).tobytes())
            Path(idx_path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._tmp_bin_path, self.bin_path)
            os.replace(tmp_idx_path, idx_path)
        except BaseException:
            _remove_quietly(tmp_idx_path)
            self.abort()
            raise

    def abort(self) -> None:
        """Drop everything written so far (the final names are never touched)."""
        if not self._bin.closed:
            self._bin.close()
        _remove_quietly(self._tmp_bin_path)


def _map_file(path: str) -> mmap.mmap:
    """A read-only map of the whole file (its `size()` is the file's current size)."""
    with open(path, "rb") as stream:
        return mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_dataset(
    prefix: PathLike,
    documents: Iterable[Sequence[Sequence[int]]],
    dtype: Any = np.uint16,
) -> None:
    """Write a dataset from documents given as lists of sequences (handy in tests and tools)."""
    with IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype) as builder:
        for sequences in documents:
            flat = [token for sequence in sequences for token in sequence]
            builder.add_document(np.asarray(flat, dtype=np.int64), [len(s) for s in sequences])
        builder.finalize(index_file_path(prefix))
