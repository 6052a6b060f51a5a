"""The decode cache's free blocks (model/decoding/cache.py): handed out lowest first, and the ranges of rows
whose pages may go back to the system (`take_releasable`) cover free blocks only, beyond the kept ones."""

from __future__ import annotations

from model.decoding import DecodeCache

from ...conftest import tiny_model


def _cache(blocks: int = 40, slots: int = 4) -> DecodeCache:
    probe = DecodeCache(tiny_model(), 0, slots, cpu_kernel=False)
    capacity = (blocks - 1) * probe.bytes_per_block + (slots + 1) * probe.reserved_bytes_per_slot
    cache = DecodeCache(tiny_model(), capacity, slots, cpu_kernel=False)
    assert cache.blocks == blocks
    return cache


def _blocks(runs: list[tuple[int, int]], block_size: int) -> set[int]:
    return {row // block_size for start, stop in runs for row in range(start, stop, block_size)}


def test_free_blocks_are_handed_out_lowest_first() -> None:
    cache = _cache()
    bs = cache.block_size
    long = cache.allocate(20 * bs)
    short = cache.allocate(2 * bs)
    assert long.blocks == list(range(1, 21)) and short.blocks == [21, 22]
    cache.free(long)
    again = cache.allocate(3 * bs)  # the long request's lowest blocks, not the last freed
    assert again.blocks == [1, 2, 3]


def test_only_free_written_blocks_beyond_the_kept_ones_are_released_once() -> None:
    cache = _cache()
    bs = cache.block_size
    short = cache.allocate(2 * bs)  # blocks 1-2, held throughout
    long = cache.allocate(20 * bs)  # blocks 3-22
    assert cache.take_releasable() == [] and cache.written_free_bytes == 0  # nothing freed yet
    cache.free(long)
    assert cache.written_free_bytes == 20 * cache.bytes_per_block
    runs = cache.take_releasable(keep_blocks=8, reach=4)
    released = _blocks(runs, bs)
    assert released == set(range(8, 27))  # blocks 8-22 written, widened by 4 free ones above; 3-7 kept
    assert not released & set(short.blocks) and 0 not in released
    assert cache.written_free_bytes == 5 * cache.bytes_per_block  # the kept blocks 3-7 stay written
    assert cache.take_releasable(keep_blocks=8, reach=4) == []  # nothing freed since
    assert _blocks(cache.take_releasable(keep_blocks=0, reach=1), bs) == set(range(3, 9))  # 0: the kept ones too
    assert cache.written_free_bytes == 0


def test_a_reused_block_is_not_released_and_written_again_counts_again() -> None:
    cache = _cache()
    bs = cache.block_size
    first = cache.allocate(10 * bs)
    cache.free(first)
    reused = cache.allocate(4 * bs)  # blocks 1-4 written again: in use, not releasable
    runs = cache.take_releasable(reach=2)
    assert _blocks(runs, bs) == set(range(5, 13))
    cache.free(reused)
    assert _blocks(cache.take_releasable(reach=2), bs) == set(range(1, 7))  # widened up to 2 free blocks past 4
