"""Which of the decode cache's blocks are free, who holds the others, and which free ones still have resident pages
(model/decoding/cache.py owns the pools and the block tables; this is the bookkeeping behind them, as vLLM's
block allocator is behind its block manager).

Invariants (`check`): block 0 is scratch, never free and never held; every other block is free (`is_free`)
exactly when no request holds it (`refs` 0), and `free_count` counts them; a spare order block is in its heap
exactly when no fork uses it; `written` holds only free blocks. Free blocks are handed out lowest first, so
running requests gather at the low end of the pools, and the pages of free blocks written since their pages
were last given back (`written`) are what `releasable` hands the owner to give back, above the lowest free ones
it keeps.

A block may also carry a kept prefix's contents (`kept_by`: its id, 0 for none; `keep`), held or free, as vLLM
keeps a freed block's cached contents until the block is handed out again. A free block that carries one is
counted free and handed out only when no other free block is left: taking one ends its prefix (every block of
that prefix is plain again, `kept_valid` false). Its pages are never given back while it carries one
(`releasable` skips it and never widens a run over it): a kept prefix's rows are read again when a request
shares its blocks (`hold`).

The flags and counts are arrays: a long request takes thousands of 8-position blocks, and the k-th
lowest free block is looked up after every turn in which one finished (`_keep_limit`), so both are a pass in C
over the blocks, not a Python loop over them (heapq.nsmallest took a fifth of the worker's time on short
questions about a 16K-token document, in a py-spy profile not kept).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

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
        self.kept_by = np.zeros(blocks, dtype=np.int64)  # the kept prefix whose contents a block carries (0: none)
        self._last_kept = 0

    def free_blocks(self) -> list[int]:
        """The free blocks, lowest first."""
        return [int(b) for b in np.flatnonzero(self.is_free)]

    def take(self, blocks: int, orders: int = 0) -> tuple[list[int], list[int]]:
        """The lowest `blocks` free blocks that carry no kept prefix, then, when those are too few, the lowest that
        do (ending their prefixes), now held once each, and `orders` spare order blocks. The caller checks that
        they are free (`free_count`, `len(free_orders)`)."""
        taken = np.flatnonzero(self.is_free & (self.kept_by == 0))[:blocks]
        if len(taken) < blocks:
            more = np.flatnonzero(self.is_free & (self.kept_by != 0))[:blocks - len(taken)]
            self._end_kept(np.unique(self.kept_by[more]))
            taken = np.sort(np.concatenate([taken, more]))
        if len(taken) < blocks:
            raise ValueError(f"{blocks} blocks asked for, {len(taken)} free")
        self.is_free[taken] = False
        self.refs[taken] = 1
        self.free_count -= len(taken)
        out: list[int] = taken.tolist()
        self.written.difference_update(out)
        self._changes += 1
        return out, [heapq.heappop(self.free_orders) for _ in range(orders)]

    def hold(self, blocks: Sequence[int] | np.ndarray) -> None:
        """One more request holds each of `blocks` (each once in the list): held already (shared with a request),
        or free and carrying a kept prefix that the request now reads (`keep`)."""
        held = np.asarray(blocks, dtype=np.int64)
        taken = held[self.refs[held] == 0]
        if len(taken) and not (self.kept_by[taken] != 0).all():
            raise ValueError("only a block in use or one that carries a kept prefix is shared")
        self.refs[held] += 1
        if len(taken):
            self.is_free[taken] = False
            self.free_count -= len(taken)
            self.written.difference_update(taken.tolist())
            self._changes += 1

    def keep(self, blocks: Sequence[int] | np.ndarray) -> int:
        """Mark `blocks` (held now, by the request whose prefix they hold) as carrying a new kept prefix, which
        replaces any they carried; returns its id (`kept_valid`, `drop_kept`)."""
        held = np.asarray(blocks, dtype=np.int64)
        if (self.refs[held] == 0).any():
            raise ValueError("a kept prefix is kept from blocks a request holds")
        self._last_kept += 1
        self._end_kept(np.unique(self.kept_by[held[self.kept_by[held] != 0]]))
        self.kept_by[held] = self._last_kept
        self._changes += 1
        return self._last_kept

    def kept_valid(self, kept: int, blocks: Sequence[int] | np.ndarray) -> bool:
        """Whether `blocks` all still carry the kept prefix `kept`: none was handed out since `keep`."""
        held = np.asarray(blocks, dtype=np.int64)
        return kept > 0 and bool((self.kept_by[held] == kept).all())

    def drop_kept(self, kept: Iterable[int]) -> None:
        """The kept prefixes `kept` (ids) end: their blocks carry nothing any more; the free ones' pages can go
        back (`releasable`)."""
        self._end_kept(np.asarray(list(kept), dtype=np.int64))

    def kept_blocks(self) -> int:
        """Blocks that carry a kept prefix."""
        return int(np.count_nonzero(self.kept_by))

    def _end_kept(self, kept: np.ndarray) -> None:
        kept = kept[kept > 0]
        if len(kept):
            self.kept_by[np.isin(self.kept_by, kept)] = 0
            self._last_take = None  # their free blocks' pages can go back now
            self._changes += 1

    def release(self, blocks: Iterable[int], orders: Iterable[int]) -> None:
        """A request lets go of `blocks` (each once; negative ones skipped: a fork's shared blocks not filled yet)
        and gives back its spare order blocks `orders`; a block no one holds any more is free again, its pages
        written."""
        held = np.asarray(blocks, dtype=np.int64)
        held = held[held >= 0]
        self.refs[held] -= 1
        freed = held[self.refs[held] == 0]
        self.is_free[freed] = True
        self.free_count += len(freed)
        for block in orders:
            heapq.heappush(self.free_orders, block)
        self.written.update(freed.tolist())
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
        written = np.fromiter(self.written, dtype=np.int64, count=len(self.written))
        pending = set(written[(written >= low) & (self.kept_by[written] == 0)].tolist())
        self.written -= pending
        plain = self.is_free & (self.kept_by == 0)  # free blocks whose rows no one reads: a run may cover them
        runs: list[tuple[int, int]] = []
        for block in sorted(pending):
            if runs and block < runs[-1][1]:
                continue  # inside the last run
            first, stop, last = block, block + 1, block
            while first > low and block - first < reach and plain[first - 1]:
                first -= 1
            while stop < self.blocks and plain[stop] and stop - last <= reach:
                last = stop if stop in pending else last
                stop += 1
            if runs and first <= runs[-1][1]:
                first = runs.pop()[0]
            runs.append((first, stop))
        return runs

    def _keep_limit(self, keep_blocks: int) -> int:
        """The block number past the `keep_blocks` lowest free blocks that carry no kept prefix (the next handed
        out; every block when fewer are free; 1, past the scratch block, for none). Memoised until the next
        change: decode turns call it too."""
        if keep_blocks <= 0:
            return 1
        memo = self._keep_memo
        if memo is not None and memo[:2] == (self._changes, keep_blocks):
            return memo[2]
        plain = np.flatnonzero(self.is_free & (self.kept_by == 0))
        limit = self.blocks if keep_blocks > len(plain) else int(plain[keep_blocks - 1]) + 1
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
        assert self.kept_by[0] == 0 and (self.kept_by >= 0).all() and (self.kept_by <= self._last_kept).all()
