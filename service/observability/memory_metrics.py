"""Memory series, read at scrape time: glibc's heap (service/memory.py), the worker's trims, the memory
budget, the decode cache's pool pages (resident, free but written, given back), and with `debug_memory` the
live tensor bytes and Python object count.

The process's RSS is `process_resident_memory_bytes` (prometheus-client's process collector). Heap series
exist only on glibc (like the GPU series only on CUDA). Set against RSS they tell a leak from retention:
a leak grows `reformer_heap_in_use_bytes`; retention grows RSS while in-use bytes stay, and a trim gives
it back (`reformer_heap_last_trim_released_bytes`).
"""

from __future__ import annotations

import bisect
import gc
import time
import typing
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.memory import RELEASE_REASONS, TRIM_REASONS, HeapKeeper, heap_stats


class PoolCache(Protocol):
    @property
    def written_free_bytes(self) -> int: ...

    @property
    def kept_prefix_bytes(self) -> int: ...


class PoolRunner(Protocol):
    """What the pool gauges read of the engine's model runner (service/engine/runner.py ModelRunner), named
    here so that observability stays below the engine."""

    @property
    def device(self) -> torch.device: ...

    @property
    def cache(self) -> PoolCache: ...

    def pool_storages(self) -> dict[int, int]: ...

HEAP_MAPPED = "reformer_heap_mapped_bytes"
HEAP_IN_USE = "reformer_heap_in_use_bytes"
HEAP_FREE = "reformer_heap_free_retained_bytes"
TRIMS = "reformer_heap_trims"
TRIM_SECONDS = "reformer_heap_trim_seconds"
LAST_RELEASED = "reformer_heap_last_trim_released_bytes"
BUDGET = "reformer_memory_budget_bytes"
POOL_RESIDENT = "reformer_decode_cache_resident_bytes"
POOL_WRITTEN_FREE = "reformer_decode_cache_written_free_bytes"
POOL_KEPT_PREFIXES = "reformer_decode_cache_kept_prefix_bytes"
POOL_RELEASED = "reformer_decode_cache_released_bytes"
PYTHON_OBJECTS = "reformer_python_objects"
LIVE_TENSORS = "reformer_live_tensor_bytes"
LIVE_TENSORS_RESIDENT = "reformer_live_tensor_resident_bytes"
# the debug view walks every object: a scrape reuses figures younger than this (Prometheus scrapes every 15 s)
DEBUG_MIN_INTERVAL_S = 30.0
_HEX = frozenset("0123456789abcdef")


def mappings(smaps: str = "/proc/self/smaps") -> list[tuple[int, int, int]] | None:
    """(start, end, resident bytes) of each of this process's mappings, None without /proc. smaps' Rss, not
    mincore: a page only ever read is mapped to the shared zero page, which mincore calls resident and RSS
    does not count (the decode cache's pools have such pages)."""
    out: list[tuple[int, int, int]] = []
    try:
        with open(smaps) as f:
            for line in f:
                if line[0] in _HEX:  # a mapping's header: "start-end perms offset dev inode path"
                    lo, _, hi = line.split(" ", 1)[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16), 0))
                elif line.startswith("Rss:") and out:
                    lo_, hi_, _ = out[-1]
                    out[-1] = (lo_, hi_, int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        return None
    return out


def attributed_resident(storages: dict[int, int], maps: list[tuple[int, int, int]]) -> int:
    """Resident bytes of the storages: each mapping's Rss shared out by the bytes of it they cover. Exact for
    a storage mapped on its own (a decode-cache pool, model/decoding/huge_pages.py); pro rata for the tensors inside
    the heap's mappings, which share them with other allocations."""
    spans = sorted((address, address + nbytes) for address, nbytes in storages.items())
    starts = [lo for lo, _ in spans]
    total = 0.0
    for lo, hi, rss in maps:
        if rss == 0 or hi <= lo:
            continue
        covered = 0
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(spans) and spans[i][0] < hi:
            covered += max(0, min(spans[i][1], hi) - max(spans[i][0], lo))
            i += 1
        total += rss * min(covered, hi - lo) / (hi - lo)
    return int(total)


def live_storages(objects: list[object]) -> dict[int, int]:
    """{address: bytes} of the distinct storages behind the tensors among `objects` (views share their
    storage). Tensors that only C++ holds are not seen: this is what Python keeps alive."""
    seen: dict[int, int] = {}
    for obj in objects:
        # type(), not isinstance(): isinstance reads obj.__class__, which some module objects turn into a
        # deprecation warning (torch.distributed.reduce_op)
        if not issubclass(type(obj), torch.Tensor):
            continue
        tensor = typing.cast(torch.Tensor, obj)
        try:
            if tensor.is_meta or tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers)
            continue
    seen.pop(0, None)  # empty storages
    return seen


def live_tensor_bytes(objects: list[object]) -> int:
    """Bytes of the distinct storages behind the tensors among `objects`."""
    return sum(live_storages(objects).values())


class MemoryCollector(Collector):
    """`keeper` gives the engine's HeapKeeper once the engine exists (None before: counters at zero); `runner`
    its ModelRunner (None before, or not given: no pool gauges)."""

    def __init__(self, keeper: Callable[[], HeapKeeper | None], debug: bool = False,
                 runner: Callable[[], PoolRunner | None] = lambda: None) -> None:
        self.keeper = keeper
        self.runner = runner
        self.debug = debug
        self._debug_figures: tuple[int, int, int | None] | None = None
        self._debug_at = 0.0

    def collect(self) -> Iterator[Metric]:
        stats = heap_stats()
        if stats is not None:
            yield GaugeMetricFamily(HEAP_MAPPED, "Bytes glibc's heap holds from the system (mallinfo2 arena + "
                                    "hblkhd), resident or not.", value=float(stats.mapped))
            yield GaugeMetricFamily(HEAP_IN_USE, "Bytes allocated through malloc and not freed (mallinfo2 "
                                    "uordblks + hblkhd): tensors, buffers, everything but Python's small "
                                    "objects.", value=float(stats.in_use))
            yield GaugeMetricFamily(HEAP_FREE, "Bytes of free chunks glibc keeps in the heap for reuse (mallinfo2 "
                                    "fordblks). A trim returns their pages to the system but they stay counted "
                                    "here until reused: RSS, not this, shows what a trim gave back.",
                                    value=float(stats.free))
        keeper = self.keeper()
        trims, seconds, released = keeper.counters() if keeper is not None else (
            dict.fromkeys(TRIM_REASONS, 0), 0.0, 0)
        family = CounterMetricFamily(TRIMS, "Heap trims (malloc_trim) by the model worker, by reason: idle (once "
                                     "per idle spell), busy (every REFORMER_BUSY_TRIM_S of work) or budget (RSS "
                                     "over the memory budget).", labels=["reason"])
        for reason in TRIM_REASONS:
            family.add_metric([reason], float(trims.get(reason, 0)))
        yield family
        yield CounterMetricFamily(TRIM_SECONDS, "Time the model worker spent in heap trims.", value=seconds)
        yield GaugeMetricFamily(LAST_RELEASED, "RSS the last heap trim gave back to the system.",
                                value=float(released))
        yield GaugeMetricFamily(BUDGET, "The memory budget (REFORMER_MEMORY_BUDGET_MB) in bytes; 0: none.",
                                value=float(keeper.budget_bytes if keeper is not None else 0))
        pool = keeper.pool_counters() if keeper is not None else dict.fromkeys(RELEASE_REASONS, 0)
        family = CounterMetricFamily(POOL_RELEASED, "Bytes of the decode cache's block-pool pages the model worker "
                                     "gave back to the system (madvise; local layers' rings are never given "
                                     "back), by reason: finished (a request ended; beyond "
                                     "REFORMER_CACHE_KEEP_MB), idle, busy or budget (with a heap trim).",
                                     labels=["reason"])
        for reason in RELEASE_REASONS:
            family.add_metric([reason], float(pool.get(reason, 0)))
        yield family
        yield from self._pool_families()
        if self.debug:
            yield from self._debug_families()

    def _pool_families(self) -> Iterator[Metric]:
        runner = self.runner()
        if runner is None or runner.device.type != "cpu":
            return
        yield GaugeMetricFamily(POOL_WRITTEN_FREE, "Bytes of the decode cache's free blocks written since their "
                                "pages were last given back: at most what its free part keeps resident.",
                                value=float(runner.cache.written_free_bytes))
        yield GaugeMetricFamily(POOL_KEPT_PREFIXES, "Bytes of the decode cache's blocks that carry a kept prefix (the "
                                "prompt blocks a finished request left for a later one to share), shared now or "
                                "free: resident, and handed out only when no other free block is left.",
                                value=float(runner.cache.kept_prefix_bytes))
        maps = mappings()
        if maps is not None:
            yield GaugeMetricFamily(POOL_RESIDENT, "Resident bytes of the decode cache's pools (/proc/self/smaps Rss "
                                    "of their mappings), whether their blocks are in use or free.",
                                    value=float(attributed_resident(runner.pool_storages(), maps)))

    def _debug_families(self) -> Iterator[Metric]:
        now = time.monotonic()
        if self._debug_figures is None or now - self._debug_at >= DEBUG_MIN_INTERVAL_S:
            self._debug_figures = debug_figures()
            self._debug_at = now
        objects, tensors, resident = self._debug_figures
        yield GaugeMetricFamily(PYTHON_OBJECTS, "Objects the garbage collector tracks (REFORMER_DEBUG_MEMORY; "
                                f"computed at most every {DEBUG_MIN_INTERVAL_S:g} s).", value=float(objects))
        yield GaugeMetricFamily(LIVE_TENSORS, "Bytes of the distinct storages of the tensors Python holds, the "
                                "decode cache's whole pools included (REFORMER_DEBUG_MEMORY).", value=float(tensors))
        if resident is not None:
            yield GaugeMetricFamily(LIVE_TENSORS_RESIDENT, "Of those bytes, the resident ones (/proc/self/smaps Rss of "
                                    "their mappings, pro rata where a mapping is shared; REFORMER_DEBUG_MEMORY).",
                                    value=float(resident))


def debug_figures() -> tuple[int, int, int | None]:
    """(objects the collector tracks, live tensor bytes, their resident bytes or None). gc.get_objects() lists
    every tracked object, and this walks them, with the GIL held: 0.17 s for 207K objects with the shipped
    model loaded, on the project's 2-core machine under load."""
    objects = gc.get_objects()
    storages = live_storages(objects)
    # read while `objects` still holds the tensors: none of these storages is unmapped meanwhile
    maps = mappings()
    count = len(objects)
    del objects
    return count, sum(storages.values()), None if maps is None else attributed_resident(storages, maps)
