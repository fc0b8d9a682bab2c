"""Near-duplicate detection: MinHash signatures of character shingles, LSH banding, and groups.

Vectorised with numpy, and cheaper than classic MinHash: a document's shingles are the 5-byte
windows of its normalised UTF-8 text packed into integers and hashed once to 64 bits; the top
7 bits choose one of 128 bins and each bin keeps its smallest hash (one-permutation hashing, Li et
al. 2012), an empty bin borrowing from the next non-empty one with a distinct offset (rotation
densification, Shrivastava and Li 2014). The fraction of equal bins of two signatures estimates
the Jaccard similarity of the shingle sets, as classic MinHash's 128 hash functions would, at one
hash per shingle instead of 128. Documents sharing one band of rows are candidates; a candidate
pair is a duplicate when its estimated similarity reaches the threshold (Megatron's 0.9).
Fingerprints are plain arrays, never pickles.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np

SHINGLE_BYTES = 5


def normalise(text: str) -> bytes:
    """Lower case, whitespace collapsed: the text whose shingles are compared."""
    return " ".join(text.lower().split()).encode("utf-8")


def shingle_hashes(data: bytes, seed: int) -> np.ndarray:
    """The sorted distinct 64-bit hashes of the 5-byte windows of `data`."""
    raw = np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    if raw.size < SHINGLE_BYTES:
        raw = np.concatenate([raw, np.zeros(SHINGLE_BYTES - raw.size, dtype=np.uint64)])
    windows = np.zeros(raw.size - SHINGLE_BYTES + 1, dtype=np.uint64)
    for offset in range(SHINGLE_BYTES):
        windows = (windows << np.uint64(8)) | raw[offset : offset + windows.size]
    # splitmix64's finaliser: every input bit reaches every output bit
    mixed = windows ^ np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.unique(mixed ^ (mixed >> np.uint64(31)))


def signature(text: str, num_perm: int = 128, seed: int = 1234) -> np.ndarray:
    """The one-permutation MinHash signature (uint32 per bin) of `text`."""
    hashes = shingle_hashes(normalise(text), seed)
    shift = np.uint64(64 - int(num_perm).bit_length() + 1)
    bins = (hashes >> shift).astype(np.int64)
    first = np.searchsorted(bins, np.arange(num_perm))  # hashes are sorted: bin order, then value
    filled = (first < bins.size) & (bins[np.minimum(first, bins.size - 1)] == np.arange(num_perm))
    values = (hashes[np.minimum(first, hashes.size - 1)] & np.uint64(0xFFFFFFFF)).astype(np.uint64)
    owners = np.flatnonzero(filled)
    # each empty bin takes the next filled bin's value (circularly), offset by the distance
    position = np.searchsorted(owners, np.arange(num_perm)) % owners.size
    source = owners[position]
    distance = (source - np.arange(num_perm)) % num_perm
    offset = distance.astype(np.uint64) * np.uint64(0x9E3779B9)
    return ((values[source] + offset) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def exact_key(text: str) -> bytes:
    """The digest of the normalised text: equal for exact duplicates."""
    return hashlib.blake2b(normalise(text), digest_size=16).digest()


class UnionFind:
    def __init__(self, size: int) -> None:
        self.parent = list(range(size))

    def find(self, item: int) -> int:
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, first: int, second: int) -> None:
        # The smaller index stays the root: each group is kept as its first document.
        a, b = self.find(first), self.find(second)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def near_duplicate_groups(
    signatures: np.ndarray, bands: int, threshold: float, groups: UnionFind
) -> int:
    """Join in `groups` the documents whose signatures agree on a band and in at least
    `threshold` of their entries; returns the number of candidate pairs compared."""
    count, num_perm = signatures.shape
    rows = num_perm // bands
    compared = 0
    for band in range(bands):
        buckets: dict[bytes, list[int]] = defaultdict(list)
        block = np.ascontiguousarray(signatures[:, band * rows : (band + 1) * rows])
        for index in range(count):
            buckets[block[index].tobytes()].append(index)
        for members in buckets.values():
            for position, item in enumerate(members[1:], 1):
                for earlier in members[:position]:
                    if groups.find(item) == groups.find(earlier):
                        break
                    compared += 1
                    if np.mean(signatures[item] == signatures[earlier]) >= threshold:
                        groups.union(item, earlier)
                        break
    return compared
