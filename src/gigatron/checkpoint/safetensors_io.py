"""Safetensors folders read and written one tensor at a time (for `gigatron convert`).

Reading: `SafetensorsFolder` opens `model.safetensors`, or the shards an index file
(`model.safetensors.index.json`) names, with `safe_open`; a tensor is read only when asked for,
and its shape and dtype are known without reading it (`meta`).

Writing: `write_safetensors(folder, plan, tensors, max_shard_bytes)` lays the tensors out in
shards from their shapes alone (`plan`: name -> meta tensor), writes every shard's header, then
writes each tensor of the stream `tensors` at its place as it comes. The file format (8-byte little-endian header length, a JSON header with dtype, shape and
byte offsets per tensor, then the raw little-endian data) is the one safetensors defines; the
index file maps every name to its shard, as `transformers` writes it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gigatron.errors import GigatronError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the largest header safetensors itself reads


def _damaged(path: Path, what: str) -> GigatronError:
    return GigatronError(
        f"{path}: not a readable safetensors file ({what}); download or save it again "
        "(save_pretrained(..., safe_serialization=True))"
    )


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header, checked against the file's size
    (a damaged file is refused with its name, never read past its end)."""
    size = path.stat().st_size if path.is_file() else -1
    if size < 8:
        raise _damaged(path, "missing" if size < 0 else f"{size} bytes, no header")
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > min(size - 8, _MAX_HEADER):
            raise _damaged(path, f"the header claims {length} bytes; the file has {size}")
        text = handle.read(length)
    try:
        header = json.loads(text.decode())
    except (UnicodeDecodeError, ValueError):
        raise _damaged(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _damaged(path, "the header is not a JSON object")
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in entries.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise _damaged(path, f"tensor {name} has no data_offsets")
        if not all(isinstance(x, int) for x in offsets) or not 0 <= offsets[0] <= offsets[1]:
            raise _damaged(path, f"tensor {name} has data_offsets {offsets}")
        if 8 + length + offsets[1] > size:
            raise _damaged(path, f"tensor {name} ends past the end of the file")
    return entries


def read_index(index: Path) -> dict[str, str]:
    """The weight map of an index file: tensor name -> shard file, each shard inside the
    index's folder (a path that leaves it, or an absolute one, is refused)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise GigatronError(
            f"{index}: not an index file (a JSON object with a weight_map); save the model "
            "again or remove the file"
        ) from None
    if not isinstance(weight_map, dict):
        raise GigatronError(f"{index}: weight_map is not an object of tensor name -> file")
    folder = index.parent.resolve()
    for name, file in weight_map.items():
        inside = isinstance(file, str) and not Path(file).is_absolute()
        if not inside or not (folder / file).resolve().is_relative_to(folder):
            raise GigatronError(
                f"{index}: tensor {name} names shard {file!r}, outside {index.parent}; refused "
                "(shards must be files of the model folder)"
            )
    return weight_map


class SafetensorsFolder:
    """The tensors of a Hugging Face folder, read lazily (a context manager)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = read_index(index)
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map = dict.fromkeys(read_header(self.folder / SINGLE_FILE), SINGLE_FILE)
        else:
            raise GigatronError(
                f"--load {self.folder}: has no {SINGLE_FILE} or {INDEX_FILE}; gigatron reads "
                "Hugging Face weights in safetensors format (save them with "
                "save_pretrained(..., safe_serialization=True))"
            )
        self.weight_map: dict[str, str] = dict(weight_map)
        self._handles: dict[str, object] = {}

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            path = self.folder / file
            if file != SINGLE_FILE:
                read_header(path)  # the index's shards are checked when first opened
            try:
                self._handles[file] = safe_open(path, "pt")
            except (SafetensorError, OSError) as error:
                raise _damaged(path, str(error)) from None
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except SafetensorError as error:
            raise _damaged(self.folder / self.weight_map[name], str(error)) from None

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored shape and dtype (nothing is read)."""
        try:
            view = self._handle(name).get_slice(name)
            shape, dtype = view.get_shape(), view.get_dtype()
        except SafetensorError as error:
            raise _damaged(self.folder / self.weight_map[name], str(error)) from None
        if dtype not in _DTYPES:
            raise GigatronError(
                f"{self.folder / self.weight_map[name]}: tensor {name} has dtype {dtype}; "
                f"gigatron reads {', '.join(_DTYPES)}"
            )
        return torch.empty(shape, dtype=_DTYPES[dtype], device="meta")

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(plan: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Names grouped into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, meta in plan.items():
        n = _nbytes(meta)
        if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _header(names: list[str], plan: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        meta = plan[name]
        if meta.dtype not in _NAMES:
            raise GigatronError(f"{name}: dtype {meta.dtype} cannot be stored in safetensors")
        end = offset + _nbytes(meta)
        header[name] = {
            "dtype": _NAMES[meta.dtype],
            "shape": list(meta.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (a view when it is contiguous: nothing is copied)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(
    folder: str | Path,
    plan: dict[str, torch.Tensor],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write the tensors `plan` lists (name -> meta tensor) into `folder`: every shard's header
    is written first, then each (name, tensor) of the stream `tensors` (any order) goes to its
    place at once, so only the tensor being written is held. Returns the file names."""
    folder = Path(folder)
    shards = plan_shards(plan, max_shard_bytes)
    single = len(shards) == 1
    files = [
        SINGLE_FILE if single else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]
    where: dict[str, tuple[int, int]] = {}  # name -> (shard, byte position in the file)
    handles = []
    try:
        for index, (file, names) in enumerate(zip(files, shards)):
            header = _header(names, plan, {"format": "pt"})
            position = len(header)
            for name in names:
                where[name] = (index, position)
                position += _nbytes(plan[name])
            out = open(folder / file, "wb")  # noqa: SIM115 - closed below, all shards at once
            handles.append(out)
            out.write(header)
            out.truncate(position)
        written = set()
        for name, tensor in tensors:
            meta = plan[name]
            if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
                raise GigatronError(
                    f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned "
                    f"{tuple(meta.shape)} {meta.dtype}"
                )
            shard, position = where[name]
            handles[shard].seek(position)
            handles[shard].write(_raw_bytes(tensor))
            written.add(name)
    finally:
        for out in handles:
            out.close()
    if written != set(plan):
        raise GigatronError(f"tensors never produced: {sorted(set(plan) - written)[:5]}")
    if not single:
        total = sum(_nbytes(m) for m in plan.values())
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files
