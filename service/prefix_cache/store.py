"""The prefix cache's memory tier: decode-state snapshots (model/decoding/snapshot.py) by key, in a byte budget
of their own, least recently used evicted first.

Invariants, checked by `check` (tests call it after every operation):
- referenced + evictable + free == capacity, in bytes, where referenced is the entries pinned (a disk write in
  flight holds its entry) and evictable the rest;
- only unpinned entries are evicted; an entry larger than the whole capacity is never stored;
- every entry's bytes are counted once.

The snapshots are copies outside the decode cache: holding one never takes a block a request could use, so a
full prefix cache never delays or fails a request (it only evicts, or declines to store).

With a time to live (`ttl_s`), an entry stored longer ago than that is not returned and is dropped (when no disk
write pins it): how long a document's state stays in memory is bounded whatever the traffic."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from model.decoding.snapshot import StateSnapshot


@dataclass
class Entry:
    snapshot: StateSnapshot
    nbytes: int
    pins: int = 0
    born: float = 0.0  # time.monotonic() when stored


class PrefixStore:
    """Thread-safe: the worker thread looks up and inserts; the disk writer unpins; scrapes read the figures."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[], None] | None = None,
                 ttl_s: float | None = None) -> None:
        self.capacity_bytes = max(int(capacity_bytes), 0)
        self.ttl_s = ttl_s if ttl_s else None
        self.on_evict = on_evict
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.referenced_bytes = 0
        self.evictable_bytes = 0
        self.evictions = 0
        self._changes = 0  # counts insertions and drops: what `_longest`'s memo is valid for
        self._longest: tuple[int, int] = (0, 0)  # (changes, positions)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.referenced_bytes - self.evictable_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: str) -> StateSnapshot | None:
        """The snapshot under `key`, now the most recently used, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if self.ttl_s is not None and time.monotonic() - entry.born > self.ttl_s:
                if entry.pins == 0:
                    self._drop(key)
                return None
            self._entries.move_to_end(key)
            return entry.snapshot

    def peek(self, key: str) -> StateSnapshot | None:
        """What `get` would return now, its recency left as it is and an expired entry left for `get` to drop."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (self.ttl_s is not None and time.monotonic() - entry.born > self.ttl_s):
                return None
            return entry.snapshot

    def put(self, key: str, snapshot: StateSnapshot, pin: bool = False) -> bool:
        """Store `snapshot` (pinned when `pin`), evicting least recently used unpinned entries for room; False
        (nothing stored, nothing evicted) when even that would not make room."""
        nbytes = snapshot.nbytes
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                if pin:
                    self._pin(self._entries[key])
                return True
            if nbytes > self.free_bytes + self.evictable_bytes:
                return False
            victims = iter([k for k, e in self._entries.items() if e.pins == 0])
            while nbytes > self.free_bytes:
                self._drop(next(victims))
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict()
            entry = Entry(snapshot, nbytes, born=time.monotonic())
            self._entries[key] = entry
            self._changes += 1
            self.evictable_bytes += nbytes
            if pin:
                self._pin(entry)
            return True

    def unpin(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise KeyError(f"prefix cache entry {key[:16]} is not pinned")
            entry.pins -= 1
            if entry.pins == 0:
                self.referenced_bytes -= entry.nbytes
                self.evictable_bytes += entry.nbytes

    def discard(self, key: str) -> None:
        """Drop the entry under `key` unless it is pinned (it then goes when unpinned and evicted)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pins == 0:
                self._drop(key)

    def clear(self) -> None:
        """Every unpinned entry goes (pinned ones stay until unpinned)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.pins == 0]:
                self._drop(key)

    def _pin(self, entry: Entry) -> None:
        if entry.pins == 0:
            self.evictable_bytes -= entry.nbytes
            self.referenced_bytes += entry.nbytes
        entry.pins += 1

    def longest(self) -> int:
        """The most positions a state held here has (0 when none is). Memoised until an entry comes or goes: the
        model worker reads it after every turn that ran something (service/engine/core.py `_hot_bytes`)."""
        with self._lock:
            if self._longest[0] != self._changes:
                most = max((e.snapshot.length for e in self._entries.values()), default=0)
                self._longest = (self._changes, most)
            return self._longest[1]

    def _drop(self, key: str) -> None:
        self._changes += 1
        entry = self._entries.pop(key)
        assert entry.pins == 0
        self.evictable_bytes -= entry.nbytes

    def check(self) -> None:
        """AssertionError when the accounting does not hold (see the module docstring)."""
        with self._lock:
            referenced = sum(e.nbytes for e in self._entries.values() if e.pins)
            evictable = sum(e.nbytes for e in self._entries.values() if not e.pins)
            assert (referenced, evictable) == (self.referenced_bytes, self.evictable_bytes), "byte counts drifted"
            assert referenced + evictable + self.free_bytes == self.capacity_bytes
            assert self.free_bytes >= 0, "over capacity"
            assert all(e.nbytes == e.snapshot.nbytes for e in self._entries.values())
