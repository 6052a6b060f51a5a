"""The process's heap: glibc's own statistics, giving its free pages back to the system, and when to do it.

`reformer serve` sets glibc's mmap and trim thresholds to 2 GB (model/decoding/runtime.py): a freed large tensor
stays in the heap, so the next one of that size is not page-faulted in again (a 4x speed-up of large
elementwise passes measured there). The price is that glibc never gives freed memory back by itself, and
with prompts of many sizes the free chunks between live ones add up: resident memory (RSS) grows with
fragmentation, not with load. `malloc_trim(0)` returns the pages of every free chunk (madvise), in every
arena, without moving anything; the chunks stay free in the heap and fault in again when reused.

The decode cache's pools (model/decoding/huge_pages.py) are mapped whole and stay resident wherever a request ever
wrote them; the pages of their free blocks can go back too (service/engine/runner.py `release_free_pages`).

`HeapKeeper` decides when the model worker gives memory back (service/engine/core.py calls it between its turns,
never during a model step): after each turn in which a request finished, the pool pages of its blocks
beyond the lowest `keep_bytes` of free blocks (REFORMER_CACHE_KEEP_MB), so that under steady load, never
idle, the pools' resident pages follow the requests running and not the most ever held at once; once per
idle spell, when nothing has run or waited for `idle_trim_s`, the heap and every free pool page; under
steady load, never idle, once every `busy_trim_s` of work the same (a soak of the shipped model with the
defaults before it kept 450-600 MB of free heap chunks from minute 5 on, 5-minute medians, growing, with the
bytes in use flat: bench/results/soak_defaults_before_busy_trim_24min.json); and, with a memory budget, the
heap and every free pool page between two turns while the RSS is above it (at most once every
`BUDGET_TRIM_INTERVAL_S`, so that a budget under the working set cannot make every step fault its memory in
again). Except over the budget, the lowest `hot_bytes()` of free blocks stay resident too (the engine passes
what a restore of the longest state its prefix cache holds in memory takes: a hit is restored into the lowest
free blocks, so it writes resident pages instead of faulting them in, idle or not).

The heap's part degrades to "unavailable" off glibc (musl, macOS): nothing raises, nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("service.memory")

# With a budget: how often the worker reads the RSS between turns (a read of /proc/self/statm), and the
# shortest time between two budget trims.
BUDGET_CHECK_S = 1.0
BUDGET_TRIM_INTERVAL_S = 10.0
TRIM_REASONS = ("idle", "busy", "budget")
# why pool pages were given back: a request finished (beyond the kept blocks), an idle, busy or budget trim
RELEASE_REASONS = ("finished", *TRIM_REASONS)


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33 (struct mallinfo2: the same fields as mallinfo, as size_t, so they do not wrap at 2 GB)
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@dataclass(frozen=True)
class HeapStats:
    """glibc's heap, in bytes (mallinfo2, over every arena)."""

    mapped: int  # obtained from the system: arenas (arena) plus mmapped chunks (hblkhd)
    in_use: int  # allocated and not freed: uordblks plus hblkhd
    free: int  # free chunks malloc keeps for reuse (fordblks), whether or not their pages are still resident
    releasable_top: int  # the free top of the main arena (keepcost)


class _Libc:
    """glibc's malloc_trim and mallinfo2 when this process runs on glibc, else None for each; madvise where
    the C library has it (any Linux libc)."""

    def __init__(self) -> None:
        self.trim: Callable[[int], int] | None = None
        self.mallinfo2: Callable[[], _Mallinfo2] | None = None
        self.madvise: Callable[[int, int, int], int] | None = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return
        advise = getattr(libc, "madvise", None)
        if advise is not None and hasattr(mmap, "MADV_DONTNEED"):
            advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            self.madvise = advise
        trim = getattr(libc, "malloc_trim", None)
        if trim is not None:
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            self.trim = trim
        info = getattr(libc, "mallinfo2", None)
        if info is not None:
            info.argtypes, info.restype = [], _Mallinfo2
            self.mallinfo2 = info


_LIBC = _Libc()


def heap_stats() -> HeapStats | None:
    """The heap's statistics, or None where glibc's mallinfo2 is not available. mallinfo2 walks every
    arena's free lists under its lock: cheap for a scrape, not for every decode step."""
    if _LIBC.mallinfo2 is None:
        return None
    info = _LIBC.mallinfo2()
    return HeapStats(mapped=info.arena + info.hblkhd, in_use=info.uordblks + info.hblkhd, free=info.fordblks,
                     releasable_top=info.keepcost)


def trim_available() -> bool:
    return _LIBC.trim is not None


def malloc_trim() -> bool:
    """Return the pages of the heap's free chunks to the system; True if any were. False where unavailable."""
    if _LIBC.trim is None:
        return False
    return bool(_LIBC.trim(0))


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
HUGE_PAGE = 2 * 2**20


def release_pages(address: int, nbytes: int) -> int:
    """Give back the pages of [address, address + nbytes) that whole 2 MiB huge pages cover (MADV_DONTNEED:
    they read as zeros when next touched, and count in RSS only once written again); returns the bytes
    advised, 0 where madvise is unavailable. Only the huge pages wholly inside: a huge page is never split
    and no byte outside the range is touched. For memory whose contents are dead (a decode-cache pool's
    free rows), never for live data."""
    if _LIBC.madvise is None:
        return 0
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or _LIBC.madvise(start, end - start, mmap.MADV_DONTNEED) != 0:
        return 0
    return end - start


def rss_bytes() -> int:
    """This process's resident set in bytes (/proc/self/statm: one read), 0 where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


# The cgroup of this process as a container sees it (cgroup v2 at the root, v1 under memory/); tests point it
# at a fake tree.
CGROUP = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this large is none.
_NO_LIMIT = 1 << 62


def _cgroup_bytes(v2_name: str, v1_name: str) -> int | None:
    for path in (CGROUP / v2_name, CGROUP / "memory" / v1_name):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return None if value >= _NO_LIMIT else value
    return None


def container_memory_limit() -> int | None:
    """The memory limit of the container (`docker run --memory`, a Kubernetes memory limit) in bytes: cgroup
    v2 `memory.max`, else v1 `memory.limit_in_bytes`; None without one. The kernel kills the process when its
    memory reaches it, and /proc/meminfo (what psutil reads) does not show it."""
    return _cgroup_bytes("memory.max", "memory.limit_in_bytes")


def container_memory_available() -> int | None:
    """What the container may still use before its limit (limit minus the cgroup's current usage), or None
    without a limit."""
    limit = container_memory_limit()
    if limit is None:
        return None
    used = _cgroup_bytes("memory.current", "memory.usage_in_bytes") or 0
    return max(0, limit - used)


class HeapKeeper:
    """When the model worker gives the heap's free pages back. The worker (one thread) calls `idle_turn`,
    `idle_wait` and `trim` while it has nothing to do and `after_work` after each turn that ran something;
    scrapes read the counters from another thread (plain attribute reads)."""

    def __init__(self, idle_trim_s: float, budget_bytes: int = 0, trim: Callable[[], bool] | None = None,
                 rss: Callable[[], int] = rss_bytes, clock: Callable[[], float] = time.monotonic,
                 release: Callable[[int], int] | None = None, keep_bytes: int | None = None,
                 busy_trim_s: float = 0.0, hot_bytes: Callable[[], int] | None = None,
                 forget: Callable[[], None] | None = None) -> None:
        """`trim`: the heap's trim (default malloc_trim where glibc has it); `release(keep)`: gives back the
        decode cache's free pool pages but those of the lowest `keep` bytes of free blocks, returns the bytes
        advised (the engine passes its runner's `release_free_pages`); a trim calls it with 0, and with
        `keep_bytes` (None: never) it runs after every turn that did work (it returns at once when no request
        finished). `busy_trim_s` (0: never): a trim after a turn of work when none ran for that long.
        `hot_bytes()`: free-block bytes every release but a budget trim's keeps resident too (at least).
        `forget()`: runs before a budget trim's release: the kept prefixes end, so their free blocks go back too."""
        self.idle_trim_s = idle_trim_s
        self.busy_trim_s = busy_trim_s
        self.budget_bytes = budget_bytes
        self.trim_function: Callable[[], bool] | None = trim if trim is not None else (
            malloc_trim if trim_available() else None)
        self.release_function = release
        self.keep_bytes = keep_bytes
        self.hot_function = hot_bytes
        self.forget_function = forget
        self.rss_function = rss
        self.clock = clock
        self.last_busy = clock()
        self.trimmed_this_spell = False
        self.waiting_idle = False  # the last idle_turn found nothing queued
        self.last_budget_check = float("-inf")
        self.last_trim_at = float("-inf")
        self.next_busy_trim = self.last_busy + busy_trim_s  # pushed on by every trim, whatever its reason
        self.trims = dict.fromkeys(TRIM_REASONS, 0)
        self.trim_seconds = 0.0
        self.last_released_bytes = 0
        self.pool_released = dict.fromkeys(RELEASE_REASONS, 0)  # pool bytes advised, by reason
        self._failures = 0
        self._lock = threading.Lock()  # counters change together: a scrape sees a whole trim or none

    @property
    def idle_enabled(self) -> bool:
        return (self.trim_function is not None or self.release_function is not None) and self.idle_trim_s > 0

    def idle_turn(self, idle: bool) -> bool:
        """The worker has nothing to run; `idle`: nothing queued either. True: trim now (once per spell)."""
        self.waiting_idle = idle
        if not idle:
            self.last_busy = self.clock()  # queued work (an embedding waiting for company) is not idleness
            self.trimmed_this_spell = False
            return False
        return (self.idle_enabled and not self.trimmed_this_spell
                and self.clock() - self.last_busy >= self.idle_trim_s)

    def idle_wait(self, timeout: float | None) -> float | None:
        """How long the idle worker may wait: `timeout` (None: until notified), shortened to wake when the
        spell's trim falls due. After the spell's trim it is `timeout` again: no polling while idle."""
        if not self.idle_enabled or self.trimmed_this_spell or not self.waiting_idle:
            return timeout
        due = max(self.last_busy + self.idle_trim_s - self.clock(), 0.0)
        return due if timeout is None else min(timeout, due)

    def after_work(self) -> None:
        """After a turn that ran prefills, a decode step or an embedding batch: the idle spell starts again, the
        pool pages of requests that finished go back beyond `keep_bytes`, and over the budget (read at most
        every BUDGET_CHECK_S), or `busy_trim_s` after the last trim, the heap and the free pool pages are
        trimmed now."""
        now = self.clock()
        self.last_busy = now
        self.trimmed_this_spell = False
        if self.keep_bytes is not None and self.release_function is not None:
            self._release_finished(self.release_function, max(self.keep_bytes, self._hot()))
        if self.busy_trim_s > 0 and now >= self.next_busy_trim:
            self.trim("busy")
            return
        if not self.budget_bytes or (self.trim_function is None and self.release_function is None) \
                or now - self.last_budget_check < BUDGET_CHECK_S:
            return
        self.last_budget_check = now
        if now - self.last_trim_at >= BUDGET_TRIM_INTERVAL_S and self.rss_function() > self.budget_bytes:
            self.trim("budget")

    def trim(self, reason: str) -> None:
        """Trim once (reason: idle, busy or budget) and count it. Never raises: a failure is logged and the worker
        goes on; the spell counts as trimmed so that a failing trim is not retried in a loop."""
        if reason == "idle":
            self.trimmed_this_spell = True
        # the next busy trim counts from this one, tried or not: a failing trim is not retried every turn
        self.next_busy_trim = self.clock() + self.busy_trim_s
        if self.trim_function is None and self.release_function is None:
            return
        before = self.rss_function()
        began = time.perf_counter()
        try:
            if self.trim_function is not None:
                self.trim_function()
            if reason == "budget" and self.forget_function is not None:
                self.forget_function()
            # free blocks only: the running requests' blocks are not touched; over the budget, every free one
            keep = 0 if reason == "budget" else self._hot()
            pool = self.release_function(keep) if self.release_function is not None else 0
        except Exception:
            self._failures += 1
            log.warning("memory trim failed (%d so far); the process keeps the memory", self._failures,
                        exc_info=self._failures == 1)
            return
        took = time.perf_counter() - began
        released = max(before - self.rss_function(), 0)  # another thread may allocate meanwhile
        self.last_trim_at = self.clock()
        with self._lock:
            self.trims[reason] += 1
            self.trim_seconds += took
            self.last_released_bytes = released
            self.pool_released[reason] += pool
        log.debug("heap trimmed (%s): %.1f MB returned in %.1f ms", reason, released / 2**20, took * 1000)

    def _hot(self) -> int:
        """`hot_bytes()`, 0 when there is none or it fails (logged): it only decides what stays resident."""
        if self.hot_function is None:
            return 0
        try:
            return max(int(self.hot_function()), 0)
        except Exception:
            log.warning("reading the bytes to keep resident failed; none kept for it", exc_info=True)
            return 0

    def _release_finished(self, release: Callable[[int], int], keep: int) -> None:
        try:
            pool = release(keep)
        except Exception:
            self._failures += 1
            log.warning("giving the decode cache's free pages back failed (%d so far)", self._failures,
                        exc_info=self._failures == 1)
            self.keep_bytes = None  # not retried after every turn
            return
        if pool:
            with self._lock:
                self.pool_released["finished"] += pool

    def counters(self) -> tuple[dict[str, int], float, int]:
        """(trims by reason, seconds spent trimming, bytes the last trim released), read together."""
        with self._lock:
            return dict(self.trims), self.trim_seconds, self.last_released_bytes

    def pool_counters(self) -> dict[str, int]:
        """Pool bytes given back (advised) by reason (RELEASE_REASONS)."""
        with self._lock:
            return dict(self.pool_released)

    def describe(self) -> dict[str, object]:
        """What /info reports."""
        return {"idle_trim_s": self.idle_trim_s, "busy_trim_s": self.busy_trim_s or None,
                "memory_budget_bytes": self.budget_bytes or None,
                "malloc_trim_available": self.trim_function is not None,
                "decode_cache_release": self.release_function is not None,
                "decode_cache_keep_bytes": self.keep_bytes,
                "decode_cache_keeps_prefix_hits": self.hot_function is not None,
                "heap_stats_available": _LIBC.mallinfo2 is not None}
