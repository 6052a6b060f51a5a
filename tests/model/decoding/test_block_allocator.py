"""The decode cache's block bookkeeping (model/decoding/block_allocator.py) under random takes, shares and
releases: its invariants hold after every operation, blocks are handed out lowest first, and the runs it gives
back cover free blocks only, never the lowest free ones it keeps, and each written block once."""

from __future__ import annotations

import random

import pytest

from model.decoding.block_allocator import BlockAllocator


@pytest.mark.parametrize("seed", range(6))
def test_random_takes_shares_and_releases_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    alloc = BlockAllocator(48)
    held: list[tuple[list[int], list[int]]] = []  # each request's blocks and spare order blocks
    for _ in range(300):
        op = rng.random()
        if op < 0.4 and alloc.free_count:
            n = rng.randint(1, min(6, alloc.free_count))
            lowest = alloc.free_blocks()[:n]
            blocks, orders = alloc.take(n, rng.randint(0, min(2, len(alloc.free_orders))))
            assert blocks == lowest  # lowest first
            held.append((blocks, orders))
        elif op < 0.55 and held:
            parent = rng.choice(held)[0]
            shared = parent[: rng.randint(1, len(parent))]
            alloc.hold(shared)  # a fork holds its parent's first blocks too
            held.append((list(shared), []))
        elif op < 0.85 and held:
            blocks, orders = held.pop(rng.randrange(len(held)))
            alloc.release(blocks, orders)
        else:
            keep = rng.randint(0, 10)
            kept = set(alloc.free_blocks()[:keep])
            written = set(alloc.written)
            runs = alloc.releasable(keep, reach=rng.randint(1, 3))
            given = {b for first, stop in runs for b in range(first, stop)}
            assert all(alloc.is_free[b] for b in given) and 0 not in given
            assert not given & kept
            assert written - kept <= given  # every written block above the kept ones goes back
            assert not alloc.written & given
        alloc.check()
        counts = [0] * alloc.blocks
        for blocks, _ in held:
            for b in blocks:
                counts[b] += 1
        assert counts == alloc.refs.tolist()


def test_a_broken_invariant_is_caught() -> None:
    alloc = BlockAllocator(8)
    alloc.take(2)
    alloc.refs[1] = 0  # held, yet counted as held by no one
    with pytest.raises(AssertionError, match="block 1"):
        alloc.check()
