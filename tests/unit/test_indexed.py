"""The .bin/.idx format: hand-built Megatron bytes, round trips of every dtype, corrupt files."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from gigatron.data.indexed import (
    DTYPE_BY_CODE,
    IndexedDataset,
    IndexedDatasetBuilder,
    optimal_dtype,
    write_dataset,
)
from gigatron.errors import GigatronError

# megatron_reference.md section b, verified against Megatron-Core: uint16, documents
# [10, 11, 12], an empty document, [20, 21].
EXAMPLE_IDX = (
    b"MMIDIDX\x00\x00"
    + struct.pack("<Q", 1)
    + bytes([8])
    + struct.pack("<QQ", 2, 4)
    + struct.pack("<2i", 3, 2)
    + struct.pack("<2q", 0, 6)
    + struct.pack("<4q", 0, 1, 1, 2)
)
EXAMPLE_BIN = bytes.fromhex("0a000b000c0014001500")


def write_example(prefix) -> None:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(EXAMPLE_IDX)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(EXAMPLE_BIN)


def test_example_bytes_are_the_documented_90():
    assert len(EXAMPLE_IDX) == 90


def test_reads_megatron_example(tmp_path):
    prefix = tmp_path / "example"
    write_example(prefix)
    ds = IndexedDataset(prefix)
    assert len(ds) == 2
    assert ds.dtype == np.uint16
    assert ds.sequence_lengths.tolist() == [3, 2]
    assert ds.sequence_pointers.tolist() == [0, 6]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]
    assert ds[0].tolist() == [10, 11, 12]
    assert ds[1].tolist() == [20, 21]
    assert ds[-1].tolist() == [20, 21]
    assert [a.tolist() for a in ds[0:2]] == [[10, 11, 12], [20, 21]]
    assert ds.get(0, offset=1).tolist() == [11, 12]
    assert ds.get(0, offset=1, length=1).tolist() == [11]
    assert ds.get(1, length=0).tolist() == []
    with pytest.raises(IndexError):
        ds.get(2)
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_writes_megatron_example_bytes(tmp_path):
    prefix = tmp_path / "written"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    builder.add_item([10, 11, 12])
    builder.end_document()
    builder.end_document()  # the empty document repeats its index
    builder.add_document(np.array([20, 21]), [2])
    builder.finalize(f"{prefix}.idx")
    assert (tmp_path / "written.idx").read_bytes() == EXAMPLE_IDX
    assert (tmp_path / "written.bin").read_bytes() == EXAMPLE_BIN
    assert sorted(os.listdir(tmp_path)) == ["written.bin", "written.idx"]


@pytest.mark.parametrize("code", sorted(DTYPE_BY_CODE))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_BY_CODE[code]
    rng = np.random.default_rng(code)
    documents = []
    for _ in range(5):
        sequences = [
            rng.integers(0, 100, size=rng.integers(0, 7)) for _ in range(rng.integers(1, 4))
        ]
        documents.append([s.astype(dtype) for s in sequences])
    prefix = tmp_path / f"d{code}"
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype) as builder:
        for sequences in documents:
            builder.add_document(np.concatenate(sequences), [len(s) for s in sequences])
        builder.finalize(f"{prefix}.idx")
    assert (tmp_path / f"d{code}.idx").read_bytes()[17] == code
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype
    flat = [s for sequences in documents for s in sequences]
    assert len(ds) == len(flat)
    for got, expected in zip(ds[:], flat):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, expected)
    counts = np.cumsum([0] + [len(d) for d in documents])
    assert ds.document_indices.tolist() == counts.tolist()
    pointers = np.concatenate([[0], np.cumsum([len(s) * dtype.itemsize for s in flat])[:-1]])
    assert ds.sequence_pointers.tolist() == pointers.tolist()
    assert (tmp_path / f"d{code}.bin").stat().st_size == sum(len(s) for s in flat) * dtype.itemsize


def test_add_index_concatenates(tmp_path):
    write_dataset(tmp_path / "a", [[[1, 2], [3]], [[4]]])
    write_dataset(tmp_path / "b", [[[5, 6, 7]], [], [[8]]])
    builder = IndexedDatasetBuilder(tmp_path / "ab.bin", dtype=np.uint16)
    builder.add_index(tmp_path / "a")
    builder.add_index(tmp_path / "b")
    builder.finalize(tmp_path / "ab.idx")
    write_dataset(tmp_path / "direct", [[[1, 2], [3]], [[4]], [[5, 6, 7]], [], [[8]]])
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ab.{ext}").read_bytes() == (tmp_path / f"direct.{ext}").read_bytes()
    assert IndexedDataset(tmp_path / "ab").document_indices.tolist() == [0, 2, 3, 4, 4, 5]


def test_add_index_rejects_other_dtype(tmp_path):
    write_dataset(tmp_path / "a", [[[1, 2]]], dtype=np.int32)
    builder = IndexedDatasetBuilder(tmp_path / "b.bin", dtype=np.uint16)
    with pytest.raises(GigatronError, match="int32"):
        builder.add_index(tmp_path / "a")
    builder.abort()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]


def test_nothing_under_final_names_before_finalize(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.uint16) as builder:
            builder.add_item([1, 2, 3])
            assert not (tmp_path / "x.bin").exists()
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_token_out_of_range_for_dtype(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.uint16)
    with pytest.raises(GigatronError, match="does not fit uint16"):
        builder.add_item(np.array([70000], dtype=np.int64))
    builder.abort()


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_pickle_reopens(tmp_path):
    write_example(tmp_path / "p")
    ds = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "p")))
    assert ds[0].tolist() == [10, 11, 12]


def test_empty_dataset(tmp_path):
    write_dataset(tmp_path / "e", [])
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0
    assert ds.document_indices.tolist() == [0]


def corrupt(tmp_path, idx: bytes, bin_: bytes = EXAMPLE_BIN) -> str:
    prefix = tmp_path / "bad"
    (tmp_path / "bad.idx").write_bytes(idx)
    (tmp_path / "bad.bin").write_bytes(bin_)
    return str(prefix)


@pytest.mark.parametrize(
    ("idx", "bin_", "message"),
    [
        (b"MMIDIDX", EXAMPLE_BIN, r"bad\.idx: truncated index"),
        (b"TNTIDX\x00\x00\x00" + EXAMPLE_IDX[9:], EXAMPLE_BIN, r"bad\.idx: not an indexed"),
        (EXAMPLE_IDX[:9] + struct.pack("<Q", 2) + EXAMPLE_IDX[17:], EXAMPLE_BIN, "version 2"),
        (EXAMPLE_IDX[:17] + bytes([9]) + EXAMPLE_IDX[18:], EXAMPLE_BIN, "dtype code 9"),
        (EXAMPLE_IDX[:-8], EXAMPLE_BIN, r"bad\.idx: size 82 bytes"),
        (EXAMPLE_IDX + b"\x00", EXAMPLE_BIN, r"bad\.idx: size 91 bytes"),
        (EXAMPLE_IDX, EXAMPLE_BIN[:-2], r"bad\.bin: size 8 bytes"),
        (EXAMPLE_IDX, EXAMPLE_BIN + b"\x00\x00", r"bad\.bin: size 12 bytes"),
        (EXAMPLE_IDX[:-8] + struct.pack("<q", 3), EXAMPLE_BIN, "document indices"),
        (EXAMPLE_IDX[:42] + struct.pack("<q", 4) + EXAMPLE_IDX[50:], EXAMPLE_BIN, "pointers"),
    ],
    ids=[
        "truncated-header",
        "wrong-magic",
        "wrong-version",
        "bad-dtype",
        "truncated-idx",
        "trailing-idx",
        "short-bin",
        "long-bin",
        "doc-index-end",
        "pointer",
    ],
)
def test_corrupt_files_are_reported(tmp_path, idx, bin_, message):
    prefix = corrupt(tmp_path, idx, bin_)
    with pytest.raises(GigatronError, match=message):
        IndexedDataset(prefix)


def test_missing_file(tmp_path):
    (tmp_path / "m.idx").write_bytes(EXAMPLE_IDX)
    with pytest.raises(GigatronError, match=r"m\.bin: not found") as error:
        IndexedDataset(tmp_path / "m")
    assert "m.idx" not in str(error.value)  # the index is there: only the data file is named
