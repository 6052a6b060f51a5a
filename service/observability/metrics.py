"""Prometheus metrics (every family listed in docs/METRICS.md), on the service's own registry.

Engine gauges, GPU memory and the heap (service/observability/memory_metrics.py) are read at scrape time by collectors;
every collector is wrapped so that one that fails is logged and skipped instead of failing the scrape. GPU
series exist only where CUDA does, heap series only on glibc.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.observability.gpu_metrics import GPU_FAMILIES, GpuCollector
from service.observability.memory_metrics import MemoryCollector
from service.observability.structured_metrics import StructuredMetrics
from service.prefix_cache.metrics import PrefixCacheMetrics

log = logging.getLogger("service.metrics")

# `*_created` timestamps double the series count and no dashboard reads them.
disable_created_metrics()

PREFIX = "reformer_"

# Explicit buckets: latency from 1 ms to ~10 min, sizes by powers of two.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(0, 18))  # 1 .. 131072
# Batch sizes are whole numbers and histogram_quantile interpolates linearly inside a bucket from its lower
# bound: with 1 the lowest bound, a run of batches of 1 read as p95 = 0.95. A bound just under 1 (and 2)
# makes that bucket (0.999, 1] so the quantile reads 1 (0.99995), and 2 reads 2.
BATCH_SIZE_BUCKETS = (0.999, 1.0, 1.999, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0,
                      192.0, 256.0)
# Label values the service knows before it first uses them: counters and histograms start at zero for each,
# so `increase()` and `rate()` see the first event (a series that appears at its first increment has no
# earlier sample to increase from, and Prometheus drops that first step).
REJECT_REASONS = ("queue_full", "timeout", "unavailable")
# where a client's leaving stopped its work: in the queue, during a prefill (sliced or not), between decode
# steps, or an embedding request between batches
DROP_STAGES = ("queued", "prefill", "decode", "embed")
BATCH_KINDS = ("embed", "prefill", "decode")



class EngineStats(Protocol):
    """What the engine reports at scrape time."""

    def stats(self) -> dict[str, Any]: ...


class SafeCollector(Collector):
    """Runs another collector, logging and dropping its failure so the rest of the scrape goes on."""

    def __init__(self, inner: Collector, name: str):
        self.inner = inner
        self.name = name

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self.inner.collect())
        except Exception:
            log.warning("metrics collector %s failed; its series are skipped in this scrape", self.name, exc_info=True)
            return []

    def describe(self) -> Iterable[Metric]:
        return []


class EngineCollector(Collector):
    """Queue sizes, running generations and decode-cache bytes, read from the engine when scraped."""

    def __init__(self, source: Callable[[], EngineStats | None]):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        engine = self.source()
        stats = engine.stats() if engine is not None else {}
        queue = GaugeMetricFamily(PREFIX + "queue_size", "Requests waiting for the model.", labels=["kind"])
        for kind in ("embed", "generate"):
            queue.add_metric([kind], float(stats.get("queued", {}).get(kind, 0)))
        yield queue
        yield GaugeMetricFamily(
            PREFIX + "running_generations", "Generations being decoded.", value=float(stats.get("running", 0))
        )
        yield GaugeMetricFamily(
            PREFIX + "engine_alive", "1 while the model worker thread runs.", value=float(stats.get("alive", 0))
        )


class DecodeCacheCollector(Collector):
    """`decode_cache_bytes{state}` (allocated, capacity) and `decode_cache_usage_ratio`: the figures the
    cache allocator last set through `ServiceMetrics.set_decode_cache`, else the engine's own `cache_bytes`
    and `cache_capacity_bytes` stats (0 where it reports none)."""

    def __init__(self, source: Callable[[], EngineStats | None]):
        self.source = source
        self.figures: tuple[float, float] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.figures is not None:
            allocated, capacity = self.figures
        else:
            engine = self.source()
            stats = engine.stats() if engine is not None else {}
            allocated = float(stats.get("cache_bytes", 0))
            capacity = float(stats.get("cache_capacity_bytes", 0))
        family = GaugeMetricFamily(PREFIX + "decode_cache_bytes", "Decode-cache memory, allocated and capacity.",
                                   labels=["state"])
        family.add_metric(["allocated"], allocated)
        family.add_metric(["capacity"], capacity)
        yield family
        yield GaugeMetricFamily(PREFIX + "decode_cache_usage_ratio", "Decode-cache bytes allocated / capacity.",
                                value=allocated / capacity if capacity > 0 else 0.0)


class ServiceMetrics:
    """Every metric the service exports, registered on one registry."""

    def __init__(self, engine_source: Callable[[], EngineStats | None] = lambda: None, debug_memory: bool = False):
        self.debug_memory = debug_memory  # the engine then leaves start-up's objects unfrozen (core.py `_run`)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests answered, by route and status.", ["route", "status"], registry=r
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused before reaching the model, by reason.", ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            PREFIX + "requests_dropped",
            "Admitted work whose client went away (a generation's sequence, or an embedding request), by the stage "
            "where it stopped: queued, prefill, decode or embed.",
            ["stage"], registry=r,
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Input tokens of completed requests.", registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated.", registry=r)
        self.duration = Histogram(
            PREFIX + "request_duration_seconds", "Time from request to response end.", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_seconds", "Time waiting for the model.", ["route"], buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_time = Histogram(
            PREFIX + "request_inference_seconds", "Time from the model starting a request to its end.", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between two tokens of one generation.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.input_tokens = Histogram(
            PREFIX + "input_tokens", "Input tokens per request.", ["route"], buckets=TOKEN_COUNT_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            PREFIX + "batch_size", "Request rows per model call (kind: embed, prefill, decode).", ["kind"],
            buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            PREFIX + "batch_tokens", "Padded tokens per model call.", ["kind"], buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(PREFIX + "inflight_requests", "API requests in progress (not probes or /metrics).",
                              registry=r)
        self.model_info = Gauge(
            PREFIX + "model_info", "The served model (value 1).",
            ["artifact_sha256", "model", "backend", "decode_backend", "device", "dtype"], registry=r,
        )
        self.backend_info = Gauge(
            PREFIX + "backend_info", "What runs (value 1): the decode step (c-fused, c-per-layer, torch, "
            "cuda-graphs), its attention (c, torch), a forward's chunk-window attention (c, torch-flash, "
            "torch-cuda-efficient, torch), the device, and the C kernels' build (installed:<variant>, first-use "
            "build, off, unavailable), and what the decode step's C products read the weights in (float32, "
            "bfloat16, int8; REFORMER_DECODE_WEIGHTS).",
            ["decode_step", "decode_attention", "prefill_attention", "device", "kernels", "decode_weights"],
            registry=r,
        )
        self.prefix_cache = PrefixCacheMetrics(r)  # its series stay 0 while the cache is off
        self.structured = StructuredMetrics(r)  # structured output's: 0 until a request asks for it
        self.decode_cache = DecodeCacheCollector(engine_source)
        self.add_collector(EngineCollector(engine_source), "engine")
        self.add_collector(self.decode_cache, "decode_cache")
        self.add_collector(GpuCollector(), "gpu")
        # the engine's HeapKeeper (service/memory.py) once it exists; heap series, trims, the memory budget
        self.add_collector(MemoryCollector(lambda: getattr(engine_source(), "memory", None), debug_memory,
                                           lambda: getattr(engine_source(), "runner", None)), "memory")
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for stage in DROP_STAGES:
            self.dropped.labels(stage)
        for kind in BATCH_KINDS:
            self.batch_size.labels(kind)
            self.batch_tokens.labels(kind)

    def init_request_series(self, routes: Iterable[tuple[str, Iterable[int]]]) -> None:
        """Start `requests_total{route,status}` at zero for each route and status it can answer (200 and
        its documented errors), and the route's histograms, so the first of each is seen by `increase()`."""
        for route, statuses in routes:
            for status in {200, *statuses}:
                self.requests.labels(route, str(status))
            for histogram in (self.duration, self.queue_time, self.inference_time, self.input_tokens):
                histogram.labels(route)

    def set_decode_cache(self, allocated: int, capacity: int) -> None:
        """The decode-cache allocator's figures in bytes (thread-safe: one tuple assignment)."""
        self.decode_cache.figures = (float(allocated), float(capacity))

    def add_collector(self, collector: Collector, name: str) -> None:
        """Register a scrape-time collector; its failures are logged and never fail a scrape."""
        self.registry.register(SafeCollector(collector, name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def exported_metric_families() -> set[str]:
    """Every metric family name the service can expose, as Prometheus shows it in `# TYPE` lines
    (GPU ones included, though a CPU host never shows them)."""
    text = ServiceMetrics().render().decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return names | set(GPU_FAMILIES)
