"""The torch.distributed.checkpoint (DCP) plumbing of the torch_dist format: planners that write
and read `Piece`s (global_view.py) and a reader whose `.metadata` pickle goes through a
restricted unpickler.

DCP's default planners take state dicts of DTensors / ShardedTensors; gigatron's pieces (a view
of local memory + global offsets) go straight into DCP's write and read items instead, which is
all those types amount to on disk. DCP's global save plan keeps one copy of a piece that several
ranks hold (same key and offsets) and checks that the pieces cover each tensor exactly.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from gigatron.checkpoint.global_view import Piece
from gigatron.errors import GigatronError
from gigatron.torch_files import enum_member


def _index(pieces: list[Piece]) -> dict[tuple[str, tuple[int, ...]], Piece]:
    table = {}
    for piece in pieces:
        where = (piece.key, tuple(piece.offsets))
        assert where not in table, f"two local pieces at {where}"
        table[where] = piece
    return table


class _PiecePlanner:
    """A DCP planner of the given pieces, keyed by (name, offsets); no state-dict flattening."""

    def __init__(self, pieces: list[Piece]) -> None:
        # super(): the DCP planner this is mixed into (DefaultSavePlanner or DefaultLoadPlanner).
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = _index(pieces)


class PieceSavePlanner(_PiecePlanner, DefaultSavePlanner):
    """Writes the given pieces (the state dict DCP passes is empty); DCP's global plan keeps one
    copy of each replicated piece and checks that every tensor is covered exactly."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator=False):
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), piece in self.pieces.items():
            t = piece.tensor
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
                        properties=TensorProperties.create_from_tensor(t),
                        size=torch.Size(piece.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        tensor = self.pieces[(index.fqn, tuple(index.offset))].tensor
        # A view of a larger storage would be written whole by torch.save: copy it out.
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.contiguous().clone()
        return tensor


class PieceLoadPlanner(_PiecePlanner, DefaultLoadPlanner):
    """Reads the checkpoint's chunks that overlap each requested piece, straight into it."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator=False):
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self):
        items: list[ReadItem] = []
        for (key, offsets), piece in self.pieces.items():
            saved = self.metadata.state_dict_metadata[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.tensor.size())
            items += create_read_items_for_chunk_list(key, saved, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[(index.fqn, tuple(index.offset))].tensor

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise GigatronError(f"{read_item.dest_index.fqn}: refused to unpickle a non-tensor entry")


# What DCP's `.metadata` pickle may name besides the classes of its metadata module: sizes,
# dtypes, the storage-location record, the saved path, and torch's layout-by-name lookup.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    # Megatron-LM's metadata also keeps its save plans: plain dataclasses and an enum
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes (plain dataclasses and enums) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return enum_member  # Python 3.11.0-3.11.4's pickles of enum members
        if module == _METADATA_MODULE:
            value = super().find_class(module, name)
            if isinstance(value, type):
                return value
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader with the `.metadata` pickle read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except pickle.UnpicklingError as exc:
            raise GigatronError(
                f"{path}: refused to load: it names Python objects other than checkpoint "
                f"metadata ({exc}); gigatron never runs code from a checkpoint"
            ) from None
        except (OSError, EOFError, ValueError) as exc:
            raise GigatronError(
                f"{path}: not a readable checkpoint index ({type(exc).__name__}: {exc}); load an "
                "earlier iteration with --ckpt-step"
            ) from None
        if not isinstance(metadata, Metadata):
            raise GigatronError(f"{path}: not a torch.distributed.checkpoint index")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is
    meant here (one-process runs pass no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def make_writer(path: Path) -> FileSystemWriter:
    """The storage writer of a save (tests replace it to slow a save down)."""
    return FileSystemWriter(path, single_file_per_rank=True, thread_count=1)


def read_metadata(iteration_dir: Path) -> Metadata:
    """DCP's index of a checkpoint, read safely."""
    return SafeFileSystemReader(iteration_dir).read_metadata()


def read_tensors(
    iteration_dir: str | Path, keys: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors `keys` (default: every tensor) of a torch_dist checkpoint, whole (one
    process; for tools, conversion and tests)."""
    iteration_dir = Path(iteration_dir)
    metadata = read_metadata(iteration_dir)
    pieces = []
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata) and (keys is None or key in keys):
            tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            pieces.append(Piece(key, tensor, (0,) * tensor.dim(), tuple(entry.size)))
    with quiet_single_process():
        dcp.load(
            {},
            storage_reader=SafeFileSystemReader(iteration_dir),
            planner=PieceLoadPlanner(pieces),
            no_dist=True,
        )
    return {piece.key: piece.tensor for piece in pieces}


def read_full_tensors(iteration_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole (one process; for tools and tests)."""
    return read_tensors(iteration_dir)
