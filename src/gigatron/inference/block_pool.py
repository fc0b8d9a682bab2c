"""The block allocator of the paged KV cache (rank 0's bookkeeping; no tensors).

The cache's memory is `num_blocks` blocks of `block_size` token positions each. Block 0 is the
scratch block: positions a step writes but nobody reads (padding) go there, and a block table
entry 0 means "no block" (a block freed because it left a sliding window). Blocks 1.. are
handed out to requests and come back when they finish, are cancelled or are preempted.

Prefix caching (optional): a block holding a full block of prompt tokens is registered under a
key that names every token up to its end (a SHA-256 chain: the previous block's key and this
block's tokens), so a later prompt starting with the same tokens reuses it instead of computing
it again. Blocks are reference-counted; a registered block whose count drops to zero stays
cached (least recently used first out) until a request needs a block and none is free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

SCRATCH_BLOCK = 0


@dataclass
class PoolCounters:
    """What the pool did: prefix hits (blocks and tokens reused), evictions of cached blocks,
    and preemptions (counted by the engine)."""

    prefix_hit_blocks: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


class BlockPool:
    """Free list, reference counts and the prefix cache of `num_blocks` blocks (block 0 is
    the scratch block, never handed out)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError("the KV block pool needs at least 2 blocks (one is scratch)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.counters = PoolCounters()
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first

    @property
    def usable(self) -> int:
        """Blocks a request can ever get (all but the scratch block)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Blocks an allocation can get now: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._idle)

    def in_use(self) -> int:
        """Blocks some request holds."""
        return sum(1 for r in self._refs if r > 0)

    def cached(self) -> int:
        """Blocks registered in the prefix cache (in use or idle)."""
        return len(self._block_of)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (reference count 1), evicting idle cached blocks when the free
        list runs out; None (nothing taken) when the pool cannot give that many."""
        if count > self.available():
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.counters.evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block (entries 0, freed slots, are skipped)."""
        for block in blocks:
            if block == SCRATCH_BLOCK:
                continue
            if self._refs[block] <= 0:
                raise RuntimeError(f"KV block {block} released more often than it was taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def match_prefix(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks holding the longest run of `tokens`' leading full blocks (at most
        `max_blocks`), each now referenced once more; counted as prefix hits."""
        if not self.prefix_caching:
            return []
        found = []
        for key in self._keys(tokens, max_blocks):
            block = self._block_of.get(key)
            if block is None:
                break
            self._idle.pop(block, None)
            self._refs[block] += 1
            found.append(block)
        self.counters.prefix_hit_blocks += len(found)
        self.counters.prefix_hit_tokens += len(found) * self.block_size
        return found

    def register(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Make the full blocks of `tokens` (held in `blocks`, in order) reusable by later
        prompts; blocks already registered, and scratch entries, are left as they are."""
        if not self.prefix_caching:
            return
        full = len(tokens) // self.block_size
        for key, block in zip(self._keys(tokens, full), blocks):
            if block == SCRATCH_BLOCK or block in self._key_of or key in self._block_of:
                continue
            self._key_of[block] = key
            self._block_of[key] = block

    def _keys(self, tokens: Sequence[int], count: int) -> list[bytes]:
        keys, previous, size = [], b"", self.block_size
        for index in range(min(count, len(tokens) // size)):
            chunk = tokens[index * size : (index + 1) * size]
            digest = hashlib.sha256(previous)
            digest.update(b",".join(str(int(t)).encode() for t in chunk))
            previous = digest.digest()
            keys.append(previous)
        return keys
