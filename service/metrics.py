"""Prometheus metrics (DESIGN.md section 6), on the service's own registry.

Engine gauges and GPU memory are read at scrape time by collectors; every collector is wrapped so that one
that fails is logged and skipped instead of failing the scrape. GPU series exist only where CUDA does.
"""

from __future__ import annotations

import logging
import threading
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
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(0, 9))  # 1 .. 256

GPU_FAMILIES = (
    "reformer_gpu_memory_allocated_bytes",
    "reformer_gpu_memory_reserved_bytes",
    "reformer_gpu_memory_peak_allocated_bytes",
    "reformer_gpu_memory_used_bytes",
    "reformer_gpu_memory_total_bytes",
    "reformer_gpu_utilization_ratio",
)


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
            PREFIX + "decode_cache_bytes", "Memory held by running generations' decode caches.",
            value=float(stats.get("cache_bytes", 0)),
        )
        yield GaugeMetricFamily(
            PREFIX + "engine_alive", "1 while the model worker thread runs.", value=float(stats.get("alive", 0))
        )


class GpuCollector(Collector):
    """GPU memory from torch's allocator stats and NVML, per visible device; nothing without CUDA."""

    def __init__(self) -> None:
        self._nvml_ready: bool | None = None
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        import torch

        if not torch.cuda.is_available():
            return
        labels = ["device"]
        allocated = GaugeMetricFamily(GPU_FAMILIES[0], "Bytes allocated by torch tensors.", labels=labels)
        reserved = GaugeMetricFamily(GPU_FAMILIES[1], "Bytes reserved by torch's caching allocator.", labels=labels)
        peak = GaugeMetricFamily(GPU_FAMILIES[2], "Peak bytes allocated by torch since start.", labels=labels)
        for index in range(torch.cuda.device_count()):
            device = str(index)
            allocated.add_metric([device], float(torch.cuda.memory_allocated(index)))
            reserved.add_metric([device], float(torch.cuda.memory_reserved(index)))
            peak.add_metric([device], float(torch.cuda.max_memory_allocated(index)))
        yield from (allocated, reserved, peak)
        yield from self._nvml()

    def _nvml(self) -> Iterator[Metric]:
        try:
            import pynvml
        except ImportError:
            return
        with self._lock:
            if self._nvml_ready is None:
                try:
                    pynvml.nvmlInit()
                    self._nvml_ready = True
                except pynvml.NVMLError:
                    log.warning("NVML is not available; GPU used/total/utilization series are skipped")
                    self._nvml_ready = False
        if not self._nvml_ready:
            return
        used = GaugeMetricFamily(GPU_FAMILIES[3], "Bytes used on the device (NVML).", labels=["device"])
        total = GaugeMetricFamily(GPU_FAMILIES[4], "Bytes on the device (NVML).", labels=["device"])
        util = GaugeMetricFamily(GPU_FAMILIES[5], "GPU busy fraction over NVML's last sample.", labels=["device"])
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            used.add_metric([str(index)], float(memory.used))
            total.add_metric([str(index)], float(memory.total))
            util.add_metric([str(index)], pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        yield from (used, total, util)


class ServiceMetrics:
    """Every metric the service exports, registered on one registry."""

    def __init__(self, engine_source: Callable[[], EngineStats | None] = lambda: None):
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
            "Admitted requests whose client went away, by where the work was dropped (queued or running).",
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
            PREFIX + "batch_size", "Sequences per model call.", ["kind"], buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            PREFIX + "batch_tokens", "Padded tokens per model call.", ["kind"], buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(PREFIX + "inflight_requests", "HTTP requests being handled.", registry=r)
        self.model_info = Gauge(
            PREFIX + "model_info", "The served model (value 1).",
            ["artifact_sha256", "model", "backend", "decode_backend", "device", "dtype"], registry=r,
        )
        self.add_collector(EngineCollector(engine_source), "engine")
        self.add_collector(GpuCollector(), "gpu")

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
