"""Which of the decode cache's blocks are free, who holds the others, and which free ones still have resident pages
(model/decoding/cache.py owns the pools and the block tables; this is the bookkeeping behind them, as vLLM's
block allocator is behind its block manager).

Invariants (`check`): block 0 is scratch, never free and never held; every other block is free (`is_free`)
exactly when no request holds it (`refs` 0), and `free_count` counts them; a spare order block is in its heap
exactly when no fork uses it; `written` holds only free blocks. Free blocks are handed out lowest first, so
running requests gather at the low end of the pools, and the pages of free blocks written since their pages
were last given back (`written`) are what `releasable` hands the owner to give back, above the lowest free ones
it keeps. The flags and counts are arrays: a long request takes thousands of 8-position blocks, and the k-th
lowest free block is looked up after every turn in which one finished (`_keep_limit`), so both are a pass in C
over the blocks, not a Python loop over them (heapq.nsmallest took a fifth of the worker's time on short
questions about a 16K-token document, in a py-spy profile not kept).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np


class BlockAllocator:
    def __init__(self, blocks: int) -> None:
        """`blocks` blocks (0 the scratch one) and a spare order block for each but the scratch one, numbered
        blocks..2 * blocks - 2 (model/decoding/cache.py: a fork's copy of the order of the positions it shares)."""
        self.blocks = blocks
        # how many requests hold each block (a fork's shared blocks are held by its parent too)
        self.refs = np.zeros(blocks, dtype=np.int32)
        self.is_free = np.ones(blocks, dtype=bool)
        self.is_free[:1] = False  # the scratch block
        self.free_count = max(blocks - 1, 0)
        self.free_orders = list(range(blocks, 2 * blocks - 1))  # spare order blocks (a heap)
        self.written: set[int] = set()  # free blocks written since their pages were last given back
        self._last_take: int | None = None  # the keep limit of the last `releasable` when no block was freed since
        self._changes = 0  # counts takes and releases: what `_keep_limit`'s memo is valid for
        self._keep_memo: tuple[int, int, int] | None = None  # (changes, keep_blocks, limit)

    def free_blocks(self) -> list[int]:
        """The free blocks, lowest first."""
        return [int(b) for b in np.flatnonzero(self.is_free)]

    def take(self, blocks: int, orders: int = 0) -> tuple[list[int], list[int]]:
        """The lowest `blocks` free blocks, now held once each, and `orders` spare order blocks. The caller checks
        that they are free (`free_count`, `len(free_orders)`)."""
        taken = np.flatnonzero(self.is_free)[:blocks]
        if len(taken) < blocks:
            raise ValueError(f"{blocks} blocks asked for, {len(taken)} free")
        self.is_free[taken] = False
        self.refs[taken] = 1
        self.free_count -= len(taken)
        out = [int(b) for b in taken]
        self.written.difference_update(out)
        self._changes += 1
        return out, [heapq.heappop(self.free_orders) for _ in range(orders)]

    def hold(self, blocks: Iterable[int]) -> None:
        """One more request holds each of `blocks` (held already, each once in the list): shared with it."""
        self.refs[np.asarray(list(blocks), dtype=np.int64)] += 1

    def release(self, blocks: Iterable[int], orders: Iterable[int]) -> None:
        """A request lets go of `blocks` (each once; negative ones skipped: a fork's shared blocks not filled yet)
        and gives back its spare order blocks `orders`; a block no one holds any more is free again, its pages
        written."""
        held = np.asarray([b for b in blocks if b >= 0], dtype=np.int64)
        self.refs[held] -= 1
        freed = held[self.refs[held] == 0]
        self.is_free[freed] = True
        self.free_count += len(freed)
        for block in orders:
            heapq.heappush(self.free_orders, block)
        self.written.update(int(b) for b in freed)
        self._last_take = None
        self._changes += 1
    def releasable(self, keep_blocks: int = 0, reach: int = 1) -> list[tuple[int, int]]:
        """Block runs [first, stop) whose pages the owner gives back now; their blocks count as given back from
        then on. Each run is a run of free blocks around the free blocks written since their last release, above
        the `keep_blocks` lowest free blocks (the next ones handed out, so they stay resident, wherever running
        requests hold the blocks below them), widened by up to `reach` free blocks on either side (given back
        already) so that it can cover whole huge pages."""
        low = self._keep_limit(keep_blocks)  # never block 0 (scratch)
        if self._last_take is not None and low >= self._last_take:
            return []  # nothing freed since a take that left no more than this (called every turn: cheap)
        self._last_take = low
        pending = {b for b in self.written if b >= low}
        self.written -= pending
        runs: list[tuple[int, int]] = []
        for block in sorted(pending):
            if runs and block < runs[-1][1]:
                continue  # inside the last run
            first, stop, last = block, block + 1, block
            while first > low and block - first < reach and self.is_free[first - 1]:
                first -= 1
            while stop < self.blocks and self.is_free[stop] and stop - last <= reach:
                last = stop if stop in pending else last
                stop += 1
            if runs and first <= runs[-1][1]:
                first = runs.pop()[0]
            runs.append((first, stop))
        return runs

    def _keep_limit(self, keep_blocks: int) -> int:
        """The block number past the `keep_blocks` lowest free blocks (every block when fewer are free; 1, past
        the scratch block, for none). Memoised until the next take or release: decode turns call it too."""
        if keep_blocks <= 0:
            return 1
        memo = self._keep_memo
        if memo is not None and memo[:2] == (self._changes, keep_blocks):
            return memo[2]
        if keep_blocks > self.free_count:
            limit = self.blocks
        else:
            limit = int(np.flatnonzero(self.is_free)[keep_blocks - 1]) + 1
        self._keep_memo = (self._changes, keep_blocks, limit)
        return limit

    def check(self) -> None:
        """AssertionError when the bookkeeping does not hold (the module docstring's invariants)."""
        assert not self.is_free[0] and self.refs[0] == 0, "the scratch block is never free nor held"
        free = set(self.free_blocks())
        assert len(free) == self.free_count, "free_count drifted"
        assert (self.refs >= 0).all(), "a block held a negative number of times"
        for block in range(1, self.blocks):
            assert bool(self.is_free[block]) == (self.refs[block] == 0), f"block {block}"
        assert len(set(self.free_orders)) == len(self.free_orders), "a spare order block is free twice"
        assert all(self.blocks <= b < 2 * self.blocks - 1 for b in self.free_orders)
        assert self.written <= free, "a written block that is not free"
