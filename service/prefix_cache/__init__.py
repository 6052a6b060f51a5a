"""The prefix cache: decode states of prompts (or of the cached part a request declares) kept after their
prefill, so that a later request with the same tokens restores the state instead of prefilling again.

What makes it exact (docs/ARCHITECTURE.md, "The prefix cache"): a request's prompt is processed the same way
whatever the cache holds (its segment prefilled in one forward, the rest fed as decode steps), and a hit
restores a copy of the very state that processing leaves (model/decoding/snapshot.py). So the answer never
depends on what the cache held: a hit gives the same bits as the miss that stored it.

Parts: keys.py (the hash chain, the identity and the cache salt it starts from), fingerprint.py (the code and
machine in the identity), store.py (the memory tier, its own byte budget, LRU, a time to live), host.py (states
kept in host memory on every device), disk.py (the optional disk tier shared across restarts and replicas),
entry_format.py and entry_key.py (its authenticated files and their key), metrics.py. This module
ties them for the engine's worker thread; disk reads (asked for when a request is queued: `read_ahead`) and
disk writes each run on a thread of their own, so the worker never waits on the folder."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.decoding import DecodeCache
from model.decoding.snapshot import StateSnapshot
from model.decoding.snapshot_layout import check_layout
from service.prefix_cache.disk import DiskTier
from service.prefix_cache.entry_format import EntryFault
from service.prefix_cache.entry_key import EntryKey, resolve_key
from service.prefix_cache.host import pin_host_memory, to_host
from service.prefix_cache.keys import CacheIdentity, chain_key, chain_links
from service.prefix_cache.metrics import PrefixCacheMetrics
from service.prefix_cache.store import PrefixStore

log = logging.getLogger("service.prefix_cache")

# the longest shutdown waits for queued disk writes (`close`)
CLOSE_WRITES_S = 30.0
# boundary keys kept before those of evicted states are swept out (`register`): about 100 bytes each
MAX_BOUNDARIES = 1 << 18

__all__ = ["CacheIdentity", "EntryKey", "PrefixCache", "PrefixCacheConfig", "PrefixStore", "resolve_key"]


@dataclass(frozen=True)
class PrefixCacheConfig:
    capacity_bytes: int
    min_tokens: int = 128  # shorter segments are neither stored nor looked up (REFORMER_PREFIX_CACHE_MIN_TOKENS)
    disk_dir: Path | None = None
    disk_bytes: int = 16 * 2**30
    key: EntryKey | None = None  # authenticates disk entries; None: a per-process key (entry_key.py)
    ttl_s: float | None = None  # memory tier: a kept state is dropped this long after it was stored
    disk_ttl_s: float | None = 86400.0  # disk tier: a file is refused and deleted this long after it was written
    write_queue_bytes: int = 2 * 2**30  # states waiting for the disk writer; past it a state is not written


# a failed write's reason label by errno (the rest: write_failed): the folder full, or not writable
WRITE_FAULTS = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full",
                errno.EROFS: "read_only", errno.EACCES: "read_only", errno.EPERM: "read_only"}


def write_fault(exc: BaseException) -> str:
    """The reason label of a disk write that raised `exc` (metrics.py REFUSALS)."""
    code = exc.errno if isinstance(exc, OSError) else None
    return WRITE_FAULTS.get(code, "write_failed") if code is not None else "write_failed"


class PrefixCache:
    def __init__(self, identity: CacheIdentity, config: PrefixCacheConfig, metrics: PrefixCacheMetrics | None,
                 vocab_size: int, device: torch.device | None = None, pin: bool | None = None) -> None:
        """`device`: the decode cache's; on any but the CPU kept states are copied to host memory (host.py),
        page-locked when `pin` (None: where CUDA is available)."""
        self.identity = identity
        self.device = device if device is not None else torch.device("cpu")
        self.pin = pin_host_memory() if pin is None else pin
        self.digest = identity.digest()
        self.config = config
        self.metrics = metrics
        self.vocab_size = vocab_size  # the logits' length a disk entry must have
        self.store = PrefixStore(config.capacity_bytes, metrics.evictions.inc if metrics is not None else None,
                                 ttl_s=config.ttl_s)
        # the key of a block boundary a kept state passed -> that state's key (`register`)
        self.boundaries: dict[str, str] = {}
        self.disk = None
        if config.disk_dir:
            key = config.key if config.key is not None else resolve_key(None, None)
            if key.source == "per-process":
                log.warning("REFORMER_PREFIX_CACHE_DIR without REFORMER_PREFIX_CACHE_KEY(_FILE): disk entries are "
                            "authenticated with a per-process key, so a restarted server or another replica "
                            "cannot read them")
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, self.digest, key, config.disk_ttl_s)
        self._writes: queue.Queue[tuple[str, StateSnapshot] | None] = queue.Queue()
        self._queued_lock = threading.Lock()
        self.queued_bytes = 0  # the states waiting in _writes (a gauge)
        self._writer: threading.Thread | None = None
        self._reads: queue.Queue[tuple[Callable[[], list[str]], DecodeCache,
                                       Callable[[StateSnapshot | None], None]] | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        if self.disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-cache-disk", daemon=True)
            self._writer.start()
        if metrics is not None:
            metrics.watch(self.store, self)

    def key(self, tokens: Sequence[int], salt: str | None = None) -> str:
        return chain_key(self.digest, tokens, salt)

    def lookup(self, key: str, tokens: int, read_ahead: StateSnapshot | None = None
               ) -> tuple[StateSnapshot, str] | None:
        """The snapshot of a segment of `tokens` tokens under `key` and the tier it came from: `read_ahead`
        (what `read_ahead` read from disk for this request), else the memory tier's, or None. The worker never
        reads the disk here. A segment shorter than min_tokens is never kept, so it is not looked up. Queries
        are counted here, hits by `hit` once the state is restored."""
        if tokens < self.config.min_tokens:
            return None
        if self.metrics is not None:
            self.metrics.queries.inc(tokens)
        if read_ahead is not None:
            return read_ahead, "disk"
        snap = self.store.get(key)
        return (snap, "memory") if snap is not None else None

    def wants_read_ahead(self, key: str, tokens: int) -> bool:
        """Whether a request's segment should be looked for on disk before it starts: a disk tier, a segment
        long enough to be kept, and not in memory now."""
        return self.disk is not None and tokens >= self.config.min_tokens and key not in self.store

    def read_ahead(self, key: str | list[str] | Callable[[], list[str]], cache: DecodeCache,
                   done: Callable[[StateSnapshot | None], None]) -> None:
        """Read the state under `key` from disk on the reader thread (`read_disk`), then call `done` with it
        (None: no usable file), there; given several keys, the state of the first one with a usable file. Given
        a function, the keys are what it returns, called on the reader thread too (a prompt's key chain is
        hashed there, not on the caller's event loop: 500K tokens take about 12 ms). Reads run one at a time,
        in the order asked."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="prefix-cache-read", daemon=True)
            self._reader.start()
        keys: Callable[[], list[str]]
        if callable(key):
            keys = key
        else:
            listed = [key] if isinstance(key, str) else list(key)
            keys = lambda: listed  # noqa: E731
        self._reads.put((keys, cache, done))

    def _read_loop(self) -> None:
        # this thread must outlive any one read: a job waits in the queue until its `done` is called
        while (item := self._reads.get()) is not None:
            find, cache, done = item
            snap = None
            try:
                keys = find()
            except Exception:  # the cache is an optimisation: the request goes on, cold
                log.exception("working out a prompt's prefix cache keys failed")
                keys = []
            for key in keys:
                if len(keys) > 1 and self.disk is not None and not self.disk.has(key):
                    continue
                if (snap := self.read_disk(key, cache)) is not None:
                    break
            try:
                done(snap)
            except Exception:
                log.exception("handing a prefix cache file's state to its request failed")

    def causal_read_ahead(self, links: Sequence[tuple[int, str]]) -> list[str]:
        """The boundary keys, longest first, a causal prompt's state is looked for on disk under before it
        starts (`read_ahead`), of `links` (a prompt's `links` short of its end): none when there is no disk tier
        or memory holds one of them already."""
        if self.disk is None:
            return []
        kept = self._kept(links)
        if any(key in self.store or key in self.boundaries for _, key in kept):
            return []
        return [key for _, key in reversed(kept)]

    def lookup_longest(self, links: Sequence[tuple[int, str]], tokens: int, read_ahead: StateSnapshot | None = None
                       ) -> tuple[int, StateSnapshot, str] | None:
        """The longest kept state among `links` (a prompt's `links` short of its end, `tokens` tokens), with
        its length and its tier: a state kept at that very boundary, or a longer one that kept a tail there
        (`register`): `read_ahead` (the disk tier's longest, read off the worker's thread when memory held
        none) unless memory now holds a longer one, else memory's, or None. What the causal prefill keeps and
        finds (REFORMER_PREFILL=causal): a state there is a function of its own tokens only, so any prompt that
        starts with them continues from it.
        Queries are counted here, hits by `hit` once the state is restored."""
        if tokens < self.config.min_tokens:
            return None
        if self.metrics is not None:
            self.metrics.queries.inc(tokens)
        # read ahead because memory held none of these boundaries when the prompt was queued; memory may hold a
        # longer one since (a prompt that waited for a reader of its document: service/engine/prefix_readers.py)
        if read_ahead is not None:
            held = self._longest(links, touch=False)
            if held is None or held[0] <= read_ahead.length:
                return read_ahead.length, read_ahead, "disk"
        found = self._longest(links, touch=True)
        return (found[0], found[1], "memory") if found is not None else None

    def _longest(self, links: Sequence[tuple[int, str]], touch: bool) -> tuple[int, StateSnapshot] | None:
        """The longest boundary among `links` the memory tier holds a state for (kept there, or a longer state's
        tail) and that state. `touch`: as a lookup (recency, expired entries and stale boundaries dropped);
        else as a peek, changing nothing."""
        read = self.store.get if touch else self.store.peek
        for length, key in reversed(self._kept(links)):
            snap = read(key)
            if snap is None and key in self.boundaries:  # a longer kept state that passed this boundary
                snap = read(self.boundaries[key])
                if snap is None and touch:
                    del self.boundaries[key]  # its state was evicted
            if snap is not None and (snap.length == length or length in snap.tails):
                return length, snap
        return None

    def peek_longest(self, links: Sequence[tuple[int, str]], tokens: int, read_ahead: StateSnapshot | None = None
                     ) -> int | None:
        """The length `lookup_longest` would find now, touching nothing (no count, no recency, nothing dropped):
        admission's guess of where a causal prompt will continue from (service/engine/prompt_reuse.py)."""
        if tokens < self.config.min_tokens:
            return None
        found = self._longest(links, touch=False)
        if read_ahead is not None and (found is None or found[0] <= read_ahead.length):
            return read_ahead.length
        return found[0] if found is not None else None

    def register(self, key: str, snapshot: StateSnapshot, links: Sequence[tuple[int, str]]) -> None:
        """Make the kept state under `key` found by the key of every block boundary among `links` (its prompt's)
        it kept a tail at (model/decoding/prefix_restore.py): a prompt that shares only the first b of its
        tokens continues from it truncated to b. Memory tier only; entries whose state is gone are dropped on
        the way."""
        if len(self.boundaries) > MAX_BOUNDARIES:
            self.boundaries = {k: e for k, e in self.boundaries.items() if e in self.store}
        for length, link in links:
            if length in snapshot.tails and link != key:
                self.boundaries[link] = key

    def links(self, tokens: Sequence[int], salt: str | None) -> list[tuple[int, str]]:
        """(length, key) after every block of the prompt's key chain (keys.py `chain_links`): computed once per
        causal prompt and handed to the methods above."""
        return chain_links(self.digest, tokens, salt)

    def _kept(self, links: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
        """The links a causal prompt's state may be kept at: those of at least min_tokens tokens."""
        return [(n, key) for n, key in links if n >= self.config.min_tokens]

    def hit(self, tier: str, tokens: int) -> None:
        """A looked-up state was restored: `tokens` tokens were not prefilled (counted in tokens, as vLLM)."""
        if self.metrics is not None:
            self.metrics.hits.labels(tier).inc(tokens)

    def read_disk(self, key: str, cache: DecodeCache) -> StateSnapshot | None:
        """The disk tier's state under `key` after every check (then kept in memory too), or None: no file, or
        one refused (counted by reason). Never raises: nothing a file holds may fail a request."""
        assert self.disk is not None
        try:
            snap = self.disk.read(key, lambda m, s: check_layout(cache, m, s, self.vocab_size))
        except EntryFault as fault:
            log.warning("refused a prefix cache file; prefilling instead: %s", fault)
            self._refused(fault.reason)
            return None
        except Exception:  # the cache is an optimisation: nothing a file holds may fail a request
            log.exception("reading a prefix cache file failed; prefilling instead")
            self._refused("io")
            return None
        if snap is None:
            return None
        if self.metrics is not None:
            self.metrics.disk_reads.inc()
        snap = to_host(snap, self.device, self.pin)  # read into plain host memory: page-locked on CUDA
        self.store.put(key, snap)
        return snap

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.disk_refusals.labels(reason).inc()

    def forget(self, key: str) -> None:
        """A kept state could not be restored: drop it from memory and from disk, so it is not read again."""
        self.store.discard(key)
        if self.disk is not None:
            try:
                self.disk.path(key).unlink(missing_ok=True)
            except OSError:
                log.warning("could not delete a prefix cache file that failed to restore", exc_info=True)
        self._refused("restore")

    def wants(self, tokens: int, nbytes: int) -> bool:
        """Whether a segment of `tokens` tokens whose state takes about `nbytes` would be kept (checked before
        the state is copied out, so a state that could never be kept costs no copy)."""
        return tokens >= self.config.min_tokens and (nbytes <= self.store.capacity_bytes or self.disk is not None)

    def offer(self, key: str, snapshot: StateSnapshot) -> bool:
        """Keep a segment's state (False: not kept: too short, or larger than the whole memory tier); with a
        disk tier it is also queued for writing there (the writer skips a file already written), pinned in
        memory until written, unless the queue already holds write_queue_bytes."""
        if snapshot.length < self.config.min_tokens:
            return False
        snapshot = to_host(snapshot, self.device, self.pin)  # in host memory, under the budget (host.py)
        write = False
        if self.disk is not None:
            with self._queued_lock:
                write = self.queued_bytes + snapshot.nbytes <= self.config.write_queue_bytes
                if write:
                    self.queued_bytes += snapshot.nbytes
            if not write:
                self._refused("queue_full")
        stored = self.store.put(key, snapshot, pin=write)
        if write:
            self._writes.put((key, snapshot))
        return stored or write

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (item := self._writes.get()) is not None:
            key, snapshot = item
            try:
                if self.disk.write(key, snapshot) and self.metrics is not None:
                    self.metrics.disk_writes.inc()
            except Exception as exc:
                reason = write_fault(exc)
                log.warning("could not write a prefix cache file (%s)", reason, exc_info=True)
                self._refused(reason)
            finally:
                with self._queued_lock:
                    self.queued_bytes -= snapshot.nbytes
                if key in self.store:
                    try:
                        self.store.unpin(key)
                    except KeyError:  # written a second time meanwhile
                        pass
                self._writes.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued disk write is done (tests, shutdown), at most `timeout_s` (None: however
        long it takes); whether they all are."""
        if self._writer is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._writes.all_tasks_done:
            while self._writes.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._writes.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = CLOSE_WRITES_S) -> None:
        """Stop the reader and the writer; queued disk writes finish first, for at most `timeout_s` (a hung
        folder must not hang shutdown: what is still queued then is not written, and said in the log)."""
        if self._reader is not None:
            self._reads.put(None)
            self._reader.join(timeout=5)
        if self._writer is not None:
            if not self.flush(timeout_s):
                log.warning("shutting down with %d prefix cache writes (%d bytes) not done after %.0f s: they are "
                            "not written", self._writes.unfinished_tasks, self.queued_bytes, timeout_s)
                return  # the writer is a daemon thread: it goes with the process
            self._writes.put(None)
            self._writer.join(timeout=5)

    def describe(self) -> dict[str, Any]:
        """What /info shows."""
        return {
            "enabled": True,
            "capacity_bytes": self.store.capacity_bytes,
            "used_bytes": self.store.referenced_bytes + self.store.evictable_bytes,
            # where kept states live (host.py): host memory always; copied there, page-locked, off a GPU
            "memory": "host" if self.device.type == "cpu" else ("host-pinned" if self.pin else "host-copy"),
            "entries": len(self.store),
            "min_tokens": self.config.min_tokens,
            "disk_dir": str(self.config.disk_dir) if self.config.disk_dir else None,
            "disk_capacity_bytes": self.config.disk_bytes if self.disk is not None else None,
            "disk_key": self.disk.key.source if self.disk is not None else None,
            "ttl_s": self.config.ttl_s,
            "disk_ttl_s": self.config.disk_ttl_s if self.disk is not None else None,
        }
