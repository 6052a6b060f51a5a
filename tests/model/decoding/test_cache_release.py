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
    # the 8 lowest free blocks (3-10, above the short request's) kept; 11-22 written, widened by 4 free ones above
    assert released == set(range(11, 27))
    assert not released & set(short.blocks) and 0 not in released
    assert cache.written_free_bytes == 8 * cache.bytes_per_block  # the kept blocks 3-10 stay written
    assert cache.take_releasable(keep_blocks=8, reach=4) == []  # nothing freed since
    assert _blocks(cache.take_releasable(keep_blocks=0, reach=1), bs) == set(range(3, 12))  # 0: the kept ones too
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


def test_the_kept_blocks_are_the_lowest_free_ones_wherever_running_requests_hold_blocks() -> None:
    cache = _cache()
    bs = cache.block_size
    running = cache.allocate(6 * bs)  # blocks 1-6 held throughout
    long = cache.allocate(12 * bs)  # blocks 7-18
    cache.free(long)
    # keep 5: the 5 lowest free blocks are 7-11, not blocks 1-5 (running's)
    assert _blocks(cache.take_releasable(keep_blocks=5, reach=1), bs) == set(range(12, 20))
    nxt = cache.allocate(5 * bs)  # the next request gets exactly the kept, still resident blocks
    assert nxt.blocks == list(range(7, 12))
    assert cache.take_releasable(keep_blocks=5, reach=1) == []  # an allocation frees nothing
    cache.free(running)
    # the 5 lowest free blocks are now 1-5: block 6 goes back, with the free ones up to 7 (reach)
    assert _blocks(cache.take_releasable(keep_blocks=5, reach=1), bs) == {6}
    assert cache.take_releasable(keep_blocks=40, reach=1) == []  # more kept than are free: all of them stay


def test_a_smaller_keep_gives_back_what_a_larger_one_kept() -> None:
    cache = _cache()
    bs = cache.block_size
    cache.free(cache.allocate(10 * bs))
    assert _blocks(cache.take_releasable(keep_blocks=8, reach=1), bs) == set(range(9, 12))
    assert cache.take_releasable(keep_blocks=8, reach=1) == []
    assert _blocks(cache.take_releasable(keep_blocks=3, reach=1), bs) == set(range(4, 10))
