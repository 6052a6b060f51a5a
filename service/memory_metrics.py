"""Memory series, read at scrape time: glibc's heap (service/memory.py), the worker's trims, the memory
budget, and with `debug_memory` the live tensor bytes and Python object count.

The process's RSS is `process_resident_memory_bytes` (prometheus-client's process collector). Heap series
exist only on glibc (like the GPU series only on CUDA). Set against RSS they tell a leak from retention:
a leak grows `reformer_heap_in_use_bytes`; retention grows RSS while in-use bytes stay, and a trim gives
it back (`reformer_heap_last_trim_released_bytes`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import time
import typing
from collections.abc import Callable, Iterator

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.memory import TRIM_REASONS, HeapKeeper, heap_stats

HEAP_MAPPED = "reformer_heap_mapped_bytes"
HEAP_IN_USE = "reformer_heap_in_use_bytes"
HEAP_FREE = "reformer_heap_free_retained_bytes"
TRIMS = "reformer_heap_trims"
TRIM_SECONDS = "reformer_heap_trim_seconds"
LAST_RELEASED = "reformer_heap_last_trim_released_bytes"
BUDGET = "reformer_memory_budget_bytes"
PYTHON_OBJECTS = "reformer_python_objects"
LIVE_TENSORS = "reformer_live_tensor_bytes"
LIVE_TENSORS_RESIDENT = "reformer_live_tensor_resident_bytes"
_PAGE = mmap.PAGESIZE
# the debug view walks every object: a scrape reuses figures younger than this (Prometheus scrapes every 15 s)
DEBUG_MIN_INTERVAL_S = 30.0


def _mincore() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
    return typing.cast(Callable[..., int], fn)


_MINCORE = _mincore()


def resident_bytes(address: int, nbytes: int) -> int | None:
    """Bytes of [address, address + nbytes) in resident pages (mincore), None where it cannot be told. A
    decode-cache pool is mapped whole and becomes resident only as it is written: its storage's size says
    nothing of its memory."""
    if _MINCORE is None or nbytes <= 0:
        return None
    start = address - address % _PAGE
    pages = -(-(address + nbytes - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _MINCORE(start, pages * _PAGE, vec) != 0:
        return None
    # bit 0 of each byte: the page is resident (the other bits are reserved); counted in C, not in Python
    return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) * _PAGE


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
    """`keeper` gives the engine's HeapKeeper once the engine exists (None before: counters at zero)."""

    def __init__(self, keeper: Callable[[], HeapKeeper | None], debug: bool = False) -> None:
        self.keeper = keeper
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
                                     "per idle spell) or budget (RSS over the memory budget).", labels=["reason"])
        for reason in TRIM_REASONS:
            family.add_metric([reason], float(trims.get(reason, 0)))
        yield family
        yield CounterMetricFamily(TRIM_SECONDS, "Time the model worker spent in heap trims.", value=seconds)
        yield GaugeMetricFamily(LAST_RELEASED, "RSS the last heap trim gave back to the system.",
                                value=float(released))
        yield GaugeMetricFamily(BUDGET, "The memory budget (REFORMER_MEMORY_BUDGET_MB) in bytes; 0: none.",
                                value=float(keeper.budget_bytes if keeper is not None else 0))
        if self.debug:
            yield from self._debug_families()

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
            yield GaugeMetricFamily(LIVE_TENSORS_RESIDENT, "Of those bytes, the ones in resident pages (mincore; "
                                    "REFORMER_DEBUG_MEMORY).", value=float(resident))


def debug_figures() -> tuple[int, int, int | None]:
    """(objects the collector tracks, live tensor bytes, their resident bytes or None). gc.get_objects() lists
    every tracked object, and this walks them, with the GIL held: 0.17 s for 207K objects with the shipped
    model loaded, on the project's 2-core machine under load."""
    objects = gc.get_objects()
    storages = live_storages(objects)
    # read while `objects` still holds the tensors: none of these storages is freed meanwhile
    resident = [resident_bytes(address, nbytes) for address, nbytes in storages.items()]
    count = len(objects)
    del objects
    return count, sum(storages.values()), sum(r or 0 for r in resident) if _MINCORE is not None else None
