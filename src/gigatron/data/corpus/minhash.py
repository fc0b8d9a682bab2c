"""Near-duplicate detection: MinHash signatures of character shingles, LSH banding, and groups.

Vectorised with numpy: a document's shingles are the 5-byte windows of its normalised UTF-8
text packed into integers; each of `num_perm` multiply-shift hash functions keeps its minimum,
so the fraction of equal signature entries estimates the Jaccard similarity of the shingle
sets. Documents sharing one band of `rows` entries are candidates; a candidate pair is a
duplicate when its estimated similarity reaches the threshold (Megatron's 0.9). Fingerprints are
plain arrays, never pickles.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np

SHINGLE_BYTES = 5
_MIX = np.uint64(0x9E3779B97F4A7C15)


def hash_functions(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The (a, b) coefficients of `num_perm` multiply-shift hashes (a odd), from `seed`."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def normalise(text: str) -> bytes:
    """Lower case, whitespace collapsed: the text whose shingles are compared."""
    return " ".join(text.lower().split()).encode("utf-8")


def shingles(data: bytes) -> np.ndarray:
    """The distinct 5-byte windows of `data` as 32-bit hashes (uint64 holding 32 bits)."""
    raw = np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    if raw.size < SHINGLE_BYTES:
        raw = np.concatenate([raw, np.zeros(SHINGLE_BYTES - raw.size, dtype=np.uint64)])
    windows = np.zeros(raw.size - SHINGLE_BYTES + 1, dtype=np.uint64)
    for offset in range(SHINGLE_BYTES):
        windows = (windows << np.uint64(8)) | raw[offset : offset + windows.size]
    return np.unique((windows * _MIX) >> np.uint64(32))


def signature(text: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The MinHash signature (uint32 per hash function) of `text`."""
    values = shingles(normalise(text))
    hashed = (a[:, None] * values[None, :] + b[:, None]) >> np.uint64(32)
    return hashed.min(axis=1).astype(np.uint32)


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
