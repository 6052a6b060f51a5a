"""The prefix cache's Prometheus families (docs/METRICS.md): counters in tokens, as vLLM counts its prefix
cache, and the memory tier's bytes read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.prefix_cache.store import PrefixStore

PREFIX = "reformer_"


class QueuedBytes(Protocol):
    queued_bytes: int


HIT_TIERS = ("memory", "disk")
# content faults (the file is deleted): corrupt, unauthenticated, foreign, expired, layout, logits, restore;
# the rest keep the file: io (reading failed); a write that failed: disk_full (ENOSPC, EDQUOT), read_only (EROFS,
# EACCES, EPERM), write_failed (any other error); queue_full (the state was not queued for writing)
REFUSALS = ("corrupt", "unauthenticated", "foreign", "expired", "layout", "logits", "restore", "io",
            "disk_full", "read_only", "write_failed", "queue_full")


class PrefixCacheMetrics(Collector):
    """Registered on the service's registry whether or not the cache is on (its series then stay 0)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, list(labels), registry=registry)

        self.queries = counter("prefix_cache_queries_tokens", "Prompt tokens of the segments looked up in the "
                               "prefix cache (a request's declared part, or its whole prompt).")
        self.hits = counter("prefix_cache_hits_tokens", "Prompt tokens restored from the prefix cache instead of "
                            "prefilled, by the tier they came from.", ("tier",))
        self.evictions = counter("prefix_cache_evictions", "Entries evicted from the memory tier to make room.")
        self.disk_reads = counter("prefix_cache_disk_reads", "Entries read back from the disk tier.")
        self.disk_writes = counter("prefix_cache_disk_writes", "Entries written to the disk tier.")
        self.disk_refusals = counter("prefix_cache_disk_refusals", "Disk-tier files refused and deleted (corrupt: "
                                     "malformed or the wrong size, unauthenticated: fails its HMAC, foreign: "
                                     "another artifact, setting or key, expired: past its time to live, layout: "
                                     "not this decode cache's tensors, logits: NaN logits, restore: a kept state "
                                     "that failed to restore) or failed and kept (io: reading failed; disk_full, "
                                     "read_only, write_failed: a write that failed, the folder full, read-only, or "
                                     "another error; queue_full: the write queue was full); the request prefilled "
                                     "instead.",
                                     ("reason",))
        self.forks = counter("prefix_cache_forks", "Generations (n / best_of choices, identical prompts) that "
                             "started from an identical segment's prefill running with them instead of their own.")
        self.shared_blocks = counter("prefix_cache_shared_blocks", "Decode-cache blocks a restored causal prompt "
                                     "shares instead of holding a copy: with a live request (running or "
                                     "prefilling) that holds the same prefix, or left behind by a finished one "
                                     "(a kept prefix).")
        self.read_waits = counter("prefix_cache_read_waits", "Causal prompts that waited for a request reading a "
                                  "long prefix of theirs, to continue from its kept state instead of reading the "
                                  "prefix beside it.")
        for tier in HIT_TIERS:
            self.hits.labels(tier)
        for reason in REFUSALS:
            self.disk_refusals.labels(reason)
        self._store: PrefixStore | None = None
        self._queue: QueuedBytes | None = None
        registry.register(self)

    def watch(self, store: PrefixStore, queue: QueuedBytes | None = None) -> None:
        self._store = store
        self._queue = queue

    def collect(self) -> Iterator[Metric]:
        store = self._store
        family = GaugeMetricFamily(PREFIX + "prefix_cache_bytes", "Memory-tier bytes by state: referenced "
                                   "(pinned by a disk write in flight), evictable, and the capacity.",
                                   labels=["state"])
        family.add_metric(["referenced"], float(store.referenced_bytes if store else 0))
        family.add_metric(["evictable"], float(store.evictable_bytes if store else 0))
        family.add_metric(["capacity"], float(store.capacity_bytes if store else 0))
        yield family
        yield GaugeMetricFamily(PREFIX + "prefix_cache_entries", "Entries in the memory tier.",
                                value=float(len(store) if store else 0))
        yield GaugeMetricFamily(PREFIX + "prefix_cache_disk_queue_bytes", "Bytes of states waiting for the disk "
                                "writer (bounded by the write queue's cap: past it a state is not written).",
                                value=float(self._queue.queued_bytes if self._queue is not None else 0))

    def describe(self) -> Iterator[Metric]:
        return iter(())
