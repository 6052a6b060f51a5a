"""The prefix cache: decode states of prompts (or of the cached part a request declares) kept after their
prefill, so that a later request with the same tokens restores the state instead of prefilling again.

What makes it exact (docs/ARCHITECTURE.md, "The prefix cache"): a request's prompt is processed the same way
whatever the cache holds (its segment prefilled in one forward, the rest fed as decode steps), and a hit
restores a copy of the very state that processing leaves (model/decoding/snapshot.py). So the answer never
depends on what the cache held: a hit gives the same bits as the miss that stored it.

Parts: keys.py (the hash chain and the identity it starts from), store.py (the memory tier, its own byte
budget, LRU), disk.py (the optional disk tier shared across restarts and replicas), metrics.py. This module
ties them for the engine's worker thread; disk writes run on a thread of their own."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.decoding import DecodeCache
from model.decoding.snapshot import StateSnapshot, check_fits
from service.prefix_cache.disk import DiskRefusal, DiskTier
from service.prefix_cache.keys import CacheIdentity, chain_key, chain_links
from service.prefix_cache.metrics import PrefixCacheMetrics
from service.prefix_cache.store import PrefixStore

log = logging.getLogger("service.prefix_cache")

# boundary keys kept before those of evicted states are swept out (`register`): about 100 bytes each
MAX_BOUNDARIES = 1 << 18

__all__ = ["CacheIdentity", "PrefixCache", "PrefixCacheConfig", "PrefixStore"]


@dataclass(frozen=True)
class PrefixCacheConfig:
    capacity_bytes: int
    min_tokens: int = 128  # shorter segments are not stored (REFORMER_PREFIX_CACHE_MIN_TOKENS)
    disk_dir: Path | None = None
    disk_bytes: int = 16 * 2**30


class PrefixCache:
    def __init__(self, identity: CacheIdentity, config: PrefixCacheConfig,
                 metrics: PrefixCacheMetrics | None = None) -> None:
        self.identity = identity
        self.digest = identity.digest()
        self.config = config
        self.metrics = metrics
        self.store = PrefixStore(config.capacity_bytes, metrics.evictions.inc if metrics is not None else None)
        # the key of a block boundary a kept state passed -> that state's key (`register`)
        self.boundaries: dict[str, str] = {}
        self.disk = DiskTier(config.disk_dir, config.disk_bytes, self.digest) if config.disk_dir else None
        self._writes: queue.Queue[tuple[str, StateSnapshot] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if self.disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-cache-disk", daemon=True)
            self._writer.start()
        if metrics is not None:
            metrics.watch(self.store)

    def key(self, tokens: Sequence[int]) -> str:
        return chain_key(self.digest, tokens)

    def lookup(self, key: str, tokens: int, cache: DecodeCache) -> StateSnapshot | None:
        """The snapshot of a segment of `tokens` tokens under `key`, from memory or else from disk (then kept
        in memory too), or None. Counted in tokens, as vLLM counts: `tokens` queried, and hit when found."""
        if self.metrics is not None:
            self.metrics.queries.inc(tokens)
        snap = self.store.get(key)
        tier = "memory"
        if snap is None and self.disk is not None:
            snap, tier = self._read_disk(key, cache), "disk"
        if snap is not None and self.metrics is not None:
            self.metrics.hits.labels(tier).inc(tokens)
        return snap

    def lookup_longest(self, tokens: Sequence[int], cache: DecodeCache) -> tuple[int, StateSnapshot] | None:
        """The longest kept state of a prefix of `tokens` that ends at a block boundary (a multiple of
        KEY_BLOCK_TOKENS, or the whole prompt), with its length, from memory or else from disk, or None. What the
        causal prefill keeps (REFORMER_PREFILL=causal): a state there is a function of its own tokens only, so
        any prompt that starts with them may continue from it. Counted as `lookup` counts: `tokens` queried,
        the state's length hit."""
        if self.metrics is not None:
            self.metrics.queries.inc(len(tokens))
        for length, key in reversed(self.links(tokens)):
            snap = self.store.get(key)
            tier = "memory"
            if snap is None and key in self.boundaries:  # a longer kept state that passed this boundary
                snap = self.store.get(self.boundaries[key])
                if snap is None:
                    del self.boundaries[key]  # its state was evicted
            if snap is None and self.disk is not None and self.disk.has(key):
                snap, tier = self._read_disk(key, cache), "disk"
            if snap is not None and (snap.length == length or length in snap.tails):
                if self.metrics is not None:
                    self.metrics.hits.labels(tier).inc(length)
                return length, snap
        return None

    def register(self, key: str, snapshot: StateSnapshot, tokens: Sequence[int]) -> None:
        """Make the kept state under `key` (the state of `tokens`) found by the key of every block boundary it
        kept a tail at (model/decoding/prefix_restore.py): a prompt that shares only the first b of its tokens
        continues from it truncated to b. Memory tier only; entries whose state is gone are dropped on the way."""
        if len(self.boundaries) > MAX_BOUNDARIES:
            self.boundaries = {k: e for k, e in self.boundaries.items() if e in self.store}
        for length, link in chain_links(self.digest, tokens):
            if length in snapshot.tails and link != key:
                self.boundaries[link] = key

    def links(self, tokens: Sequence[int]) -> list[tuple[int, str]]:
        """(length, key) of each of the prompt's prefixes the causal prefill may keep: those at block
        boundaries of at least min_tokens tokens, and the whole prompt."""
        return [(n, key) for n, key in chain_links(self.digest, tokens) if n >= self.config.min_tokens]

    def _read_disk(self, key: str, cache: DecodeCache) -> StateSnapshot | None:
        assert self.disk is not None
        try:
            snap = self.disk.read(key)
            if snap is None:
                return None
            try:
                check_fits(cache, snap)
            except ValueError as exc:
                self.disk.path(key).unlink(missing_ok=True)
                raise DiskRefusal("layout", f"prefix cache file {key}.safetensors: {exc}") from exc
        except DiskRefusal as refusal:
            log.warning("refused a prefix cache file; prefilling instead: %s", refusal)
            if self.metrics is not None:
                self.metrics.disk_refusals.labels(refusal.reason).inc()
            return None
        except OSError:
            log.warning("could not read a prefix cache file; prefilling instead", exc_info=True)
            if self.metrics is not None:
                self.metrics.disk_refusals.labels("io").inc()
            return None
        if self.metrics is not None:
            self.metrics.disk_reads.inc()
        self.store.put(key, snap)
        return snap

    def forget(self, key: str) -> None:
        """Drop the memory tier's entry under `key` (one that could not be restored)."""
        self.store.discard(key)

    def wants(self, tokens: int, nbytes: int) -> bool:
        """Whether a segment of `tokens` tokens whose state takes about `nbytes` would be kept (checked before
        the state is copied out, so a state that could never be kept costs no copy)."""
        return tokens >= self.config.min_tokens and (nbytes <= self.store.capacity_bytes or self.disk is not None)

    def offer(self, key: str, snapshot: StateSnapshot) -> bool:
        """Keep a segment's state (False: not kept: too short, or larger than the whole memory tier); with a
        disk tier it is also written there, pinned in memory until written."""
        if snapshot.length < self.config.min_tokens:
            return False
        write = self.disk is not None and not self.disk.has(key)
        stored = self.store.put(key, snapshot, pin=write)
        if write:
            self._writes.put((key, snapshot))
        return stored or write

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (item := self._writes.get()) is not None:
            key, snapshot = item
            try:
                self.disk.write(key, snapshot)
                if self.metrics is not None:
                    self.metrics.disk_writes.inc()
            except Exception:
                log.warning("could not write a prefix cache file", exc_info=True)
                if self.metrics is not None:
                    self.metrics.disk_refusals.labels("write_failed").inc()
            finally:
                if key in self.store:
                    try:
                        self.store.unpin(key)
                    except KeyError:  # written a second time meanwhile
                        pass
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every queued disk write is done (tests, shutdown)."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(timeout=5)

    def describe(self) -> dict[str, Any]:
        """What /info shows."""
        return {
            "enabled": True,
            "capacity_bytes": self.store.capacity_bytes,
            "used_bytes": self.store.referenced_bytes + self.store.evictable_bytes,
            "entries": len(self.store),
            "min_tokens": self.config.min_tokens,
            "disk_dir": str(self.config.disk_dir) if self.config.disk_dir else None,
            "disk_capacity_bytes": self.config.disk_bytes if self.disk is not None else None,
        }
