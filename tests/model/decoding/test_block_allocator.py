"""The decode cache's block bookkeeping (model/decoding/block_allocator.py) under random takes, shares and
releases: its invariants hold after every operation, blocks are handed out lowest first, and the runs it gives
back cover free blocks only, never the lowest free ones it keeps, and each written block once. With kept
prefixes (a freed request's first blocks, kept for a later one to share): free blocks that carry one are handed
out only when no other is free, which ends every prefix that loses a block, and their pages never go back."""

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


@pytest.mark.parametrize("seed", range(6))
def test_kept_prefixes_are_handed_out_last_and_never_given_back(seed: int) -> None:
    rng = random.Random(seed)
    alloc = BlockAllocator(40)
    held: list[list[int]] = []  # each request's blocks
    kept: dict[int, list[int]] = {}  # the model: each live kept prefix's blocks
    for _ in range(400):
        op = rng.random()
        carried = {b for blocks in kept.values() for b in blocks}
        if op < 0.3 and alloc.free_count:
            n = rng.randint(1, min(8, alloc.free_count))
            plain = [b for b in alloc.free_blocks() if b not in carried]
            expect = sorted(plain[:n] + [b for b in alloc.free_blocks() if b in carried][:max(n - len(plain), 0)])
            blocks, _ = alloc.take(n)
            assert blocks == expect  # free blocks with no kept prefix first, lowest first
            for k in [k for k, bs in kept.items() if set(bs) & set(blocks)]:
                del kept[k]  # a prefix that lost a block ends whole
            held.append(blocks)
        elif op < 0.45 and held:
            blocks = rng.choice(held)
            first = blocks[: rng.randint(1, len(blocks))]
            ended = {alloc.kept_by[b] for b in first} - {0}
            k = alloc.keep(first)
            for e in ended:
                kept.pop(int(e), None)  # its blocks now carry the new prefix, or nothing
            kept[k] = first
        elif op < 0.6 and kept:
            k, blocks = rng.choice(list(kept.items()))
            assert alloc.kept_valid(k, blocks)
            share = blocks[: rng.randint(1, len(blocks))]
            free_before = alloc.free_count
            alloc.hold(share)  # a later request shares them, free or held
            assert alloc.free_count == free_before - sum(1 for b in share if b not in {x for r in held for x in r})
            held.append(list(share))
        elif op < 0.85 and held:
            alloc.release(held.pop(rng.randrange(len(held))), [])
        elif op < 0.9 and kept:
            k = rng.choice(list(kept))
            alloc.drop_kept([k])
            del kept[k]
        else:
            runs = alloc.releasable(rng.randint(0, 6), reach=rng.randint(1, 3))
            given = {b for first, stop in runs for b in range(first, stop)}
            assert not given & carried  # a kept prefix's rows are read again when it is shared
        alloc.check()
        assert {b: k for k, bs in kept.items() for b in bs} == {b: int(alloc.kept_by[b])
                                                               for b in range(alloc.blocks) if alloc.kept_by[b]}
        for k, blocks in kept.items():
            assert alloc.kept_valid(k, blocks)
        counts = [0] * alloc.blocks
        for blocks in held:
            for b in blocks:
                counts[b] += 1
        assert counts == alloc.refs.tolist()


def test_only_a_held_or_kept_block_is_shared() -> None:
    alloc = BlockAllocator(8)
    blocks, _ = alloc.take(3)
    k = alloc.keep(blocks[:2])
    alloc.release(blocks, [])
    with pytest.raises(ValueError, match="carries a kept prefix"):
        alloc.hold([blocks[2]])  # free, and carries nothing: its rows are dead
    alloc.hold(blocks[:2])
    assert alloc.kept_valid(k, blocks[:2]) and alloc.free_count == 5
    with pytest.raises(ValueError, match="a request holds"):
        alloc.keep([blocks[2]])
