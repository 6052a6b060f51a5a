"""The prefix cache's Prometheus families (docs/METRICS.md): counters in tokens, as vLLM counts its prefix
cache, and the memory tier's bytes read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.prefix_cache.store import PrefixStore

PREFIX = "reformer_prefix_cache_"
HIT_TIERS = ("memory", "disk")
REFUSALS = ("corrupt", "foreign", "layout", "io", "write_failed")


class PrefixCacheMetrics(Collector):
    """Registered on the service's registry whether or not the cache is on (its series then stay 0)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.queries = Counter(PREFIX + "queries_tokens", "Prompt tokens of the segments looked up in the prefix "
                               "cache (a request's cached part, or its whole prompt).", registry=r)
        self.hits = Counter(PREFIX + "hits_tokens", "Prompt tokens restored from the prefix cache instead of "
                            "prefilled, by the tier they came from.", ["tier"], registry=r)
        self.evictions = Counter(PREFIX + "evictions", "Entries evicted from the memory tier to make room.",
                                 registry=r)
        self.disk_reads = Counter(PREFIX + "disk_reads", "Entries read back from the disk tier.", registry=r)
        self.disk_writes = Counter(PREFIX + "disk_writes", "Entries written to the disk tier.", registry=r)
        self.disk_refusals = Counter(PREFIX + "disk_refusals", "Disk-tier files refused (corrupt, foreign: another "
                                     "artifact or setting, layout: another cache layout) or failed (io, "
                                     "write_failed); the request prefilled instead.", ["reason"], registry=r)
        self.forks = Counter(PREFIX + "forks", "Requests (n / best_of choices, identical prompts) that copied "
                             "another in-flight request's prefilled state instead of prefilling.", registry=r)
        for tier in HIT_TIERS:
            self.hits.labels(tier)
        for reason in REFUSALS:
            self.disk_refusals.labels(reason)
        self._store: PrefixStore | None = None
        registry.register(self)

    def watch(self, store: PrefixStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store = self._store
        family = GaugeMetricFamily(PREFIX + "bytes", "Memory-tier bytes by state: referenced (pinned by a disk "
                                   "write in flight), evictable, and the capacity.", labels=["state"])
        family.add_metric(["referenced"], float(store.referenced_bytes if store else 0))
        family.add_metric(["evictable"], float(store.evictable_bytes if store else 0))
        family.add_metric(["capacity"], float(store.capacity_bytes if store else 0))
        yield family
        yield GaugeMetricFamily(PREFIX + "entries", "Entries in the memory tier.",
                                value=float(len(store) if store else 0))

    def describe(self) -> Iterator[Metric]:
        return iter(())
