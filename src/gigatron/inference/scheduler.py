"""The dynamic engine's scheduler: which requests run in the next step, how many of their tokens,
and in which KV blocks (rank 0's bookkeeping over a `BlockPool`).

A step is built under a token budget (`max_tokens`): first every decoding request (one token
each, oldest first), then the unfinished prefills of running requests, then newcomers from the
queue while a request slot is free. With chunked prefill a prompt longer than what is left of
the budget is fed in chunks over several steps; without it a prompt is fed whole (the first
prompt of a step may pass the budget, so that a long prompt never waits for ever).

Memory is admitted by blocks: a newcomer joins only when the pool can hold its whole prompt
(after reusing the cached blocks of its prefix) with one spare block per running request. A
decoding request that needs a block when none is left preempts the most recently admitted
request: its blocks go back to the pool and it waits at the head of the queue, to be
recomputed (prompt and tokens so far) when it is admitted again. A request that fits the pool
alone therefore always finishes, and nothing fails for want of memory.

A request is any object with `prompt_ids`/`output_ids` (through `tokens()`), `cached` (tokens
whose keys and values are in its blocks), `blocks` (its block table), `slot` and `order`
(admission order), and `wants_whole_prompt` (prompt log-probs: fed whole, from position 0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gigatron.inference.block_pool import SCRATCH_BLOCK, BlockPool, blocks_for


@dataclass(frozen=True)
class DynamicSettings:
    """The dynamic engine's choices (Megatron's flags in brackets): `block_size`
    [--inference-dynamic-batching-block-size], `buffer_bytes` for the KV blocks of each rank
    [--inference-dynamic-batching-buffer-size-gb; None: what the static cache would take],
    `max_tokens` per step [--inference-dynamic-batching-max-tokens], `chunked_prefill`
    [--enable-chunked-prefill], `prefix_caching` [--inference-dynamic-batching-prefix-caching]."""

    block_size: int = 256
    buffer_bytes: int | None = None
    max_tokens: int = 2048
    chunked_prefill: bool = False
    prefix_caching: bool = False


def packing_pays(lengths: list[int], ends: list[int], hidden: int) -> bool:
    """Whether a step of rows feeding `lengths` tokens (up to positions `ends`) costs less packed
    than padded. Per layer, a token's linear layers cost about 12 hidden^2 multiply-adds and a
    (query, key) pair of attention 2 hidden: packed rows compute only real tokens but each query
    meets every request's keys; padded rows compute padding but only their own keys."""
    tokens, keys = sum(lengths), sum(ends)
    padded = len(lengths) * max(lengths)
    packed_cost = tokens * (6 * hidden + keys)
    padded_cost = padded * (6 * hidden + max(ends))
    return packed_cost < padded_cost


class BlockScheduler:
    """Plans steps over `slots` request slots and the blocks of `pool` (module docstring).
    `window`: every attention layer's left sliding window (blocks that leave it are freed)."""

    def __init__(
        self,
        pool: BlockPool,
        slots: int,
        max_tokens: int,
        chunked_prefill: bool,
        window: int | None = None,
    ) -> None:
        self.pool = pool
        self.slots = slots
        self.max_tokens = max_tokens
        self.chunked_prefill = chunked_prefill
        self.window = window
        self._order = 0

    def check_fits(self, total_tokens: int) -> None:
        """ValueError when a request of `total_tokens` (prompt + max_tokens) cannot fit the pool
        even alone."""
        needed = blocks_for(total_tokens, self.pool.block_size)
        if needed > self.pool.usable:
            raise ValueError(
                f"the prompt plus max_tokens ({total_tokens} tokens) needs {needed} KV blocks of "
                f"{self.pool.block_size} tokens; the pool holds {self.pool.usable}"
            )

    def schedule(self, running: dict, waiting: deque) -> list[tuple[object, int]]:
        """This step's rows, (request, tokens to feed), updating `running` (slot -> request)
        and `waiting` (admissions, preemptions)."""
        rows: list[tuple[object, int]] = []
        budget = self.max_tokens
        decoding = [r for r in self._by_age(running) if len(r.tokens()) - r.cached == 1]
        for request in decoding:  # a request preempted by an older one has left `running`
            if request.slot in running and self._grow(request, running, waiting):
                rows.append((request, 1))
                budget -= 1
        for request in self._by_age(running):
            if len(request.tokens()) - request.cached > 1:
                budget = self._add_prefill(rows, request, budget)
        while waiting and len(running) < self.slots and budget > 0:
            request = waiting[0]
            if not self._admit(request, running):
                break
            waiting.popleft()
            budget = self._add_prefill(rows, request, budget)
        return rows

    def after_step(self, rows: list[tuple[object, int]]) -> None:
        """Register newly filled prompt blocks for reuse and free blocks out of the window."""
        size = self.pool.block_size
        for request, count in rows:
            if request.cached // size > (request.cached - count) // size:
                self.pool.register(request.tokens()[: request.cached], request.blocks)
            if self.window is not None:
                self._free_outside_window(request)

    def release(self, request) -> None:
        """Give a finished (or failed, cancelled, preempted) request's blocks back."""
        self.pool.release(request.blocks)
        request.blocks = []

    def _by_age(self, running: dict) -> list:
        return sorted(running.values(), key=lambda r: r.order)

    def _add_prefill(self, rows: list, request, budget: int) -> int:
        left = len(request.tokens()) - request.cached
        if request.wants_whole_prompt or not self.chunked_prefill:
            # Whole prompts: the first of a step may pass the budget (else a long prompt could
            # wait behind decode tokens for ever); the others wait for a step with room.
            prefilling = any(len(r.tokens()) - r.cached > 1 for r, _ in rows)
            if left > budget and prefilling:
                return budget
            count = left
        else:
            count = min(left, budget)
            if count <= 0:
                return budget
        rows.append((request, count))
        return budget - count

    def _admit(self, request, running: dict) -> bool:
        tokens = request.tokens()
        reuse = 0 if request.wants_whole_prompt else (len(tokens) - 1) // self.pool.block_size
        shared = self.pool.match_prefix(tokens, reuse)
        needed = blocks_for(len(tokens), self.pool.block_size) - len(shared)
        fresh = None
        if self.pool.available() >= needed + len(running):
            fresh = self.pool.allocate(needed)
        if fresh is None:
            self.pool.release(shared)
            return False
        request.blocks = shared + fresh
        request.cached = len(shared) * self.pool.block_size
        request.slot = min(set(range(self.slots)) - set(running))
        request.order = self._order
        self._order += 1
        running[request.slot] = request
        return True

    def _grow(self, request, running: dict, waiting: deque) -> bool:
        """Make room for `request`'s next position, preempting the newest requests as needed;
        False when `request` itself had to go."""
        if request.cached < len(request.blocks) * self.pool.block_size:
            return True
        while True:
            block = self.pool.allocate(1)
            if block is not None:
                request.blocks.extend(block)
                return True
            victim = self._by_age(running)[-1]
            self._preempt(victim, running, waiting)
            if victim is request:
                return False

    def _preempt(self, request, running: dict, waiting: deque) -> None:
        del running[request.slot]
        self.release(request)
        request.cached = 0
        request.slot = -1
        waiting.appendleft(request)
        self.pool.counters.preemptions += 1

    def _free_outside_window(self, request) -> None:
        # The next query is at position `cached`: keys before cached - window are never read.
        first_needed = max(0, request.cached - self.window)
        for index in range(first_needed // self.pool.block_size):
            block = request.blocks[index]
            if block != SCRATCH_BLOCK:
                self.pool.release([block])
                request.blocks[index] = SCRATCH_BLOCK
