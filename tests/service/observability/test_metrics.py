"""Metrics: every family documented for dashboards exists, and a failing collector never breaks a scrape."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from service.observability.metrics import GPU_FAMILIES, ServiceMetrics, exported_metric_families
from tests.service.helpers import running_app

DESIGN_FAMILIES = {
    "reformer_requests_total", "reformer_requests_rejected_total", "reformer_prompt_tokens_total",
    "reformer_generated_tokens_total", "reformer_request_duration_seconds", "reformer_request_queue_seconds",
    "reformer_request_inference_seconds", "reformer_time_to_first_token_seconds",
    "reformer_inter_token_latency_seconds", "reformer_input_tokens", "reformer_batch_size", "reformer_batch_tokens",
    "reformer_queue_size", "reformer_inflight_requests", "reformer_model_info", "reformer_decode_cache_bytes",
    "reformer_decode_cache_usage_ratio",
}
# Written out, not imported: tests/service/observability/test_gpu_collector.py proves the collector emits exactly these.
DESIGN_GPU_FAMILIES = {
    "reformer_gpu_memory_allocated_bytes", "reformer_gpu_memory_reserved_bytes",
    "reformer_gpu_memory_peak_allocated_bytes", "reformer_gpu_memory_used_bytes", "reformer_gpu_memory_total_bytes",
    "reformer_gpu_utilization_ratio", "reformer_gpu_process_memory_bytes",
}


def test_exported_families_cover_design_section_6() -> None:
    families = exported_metric_families()
    assert DESIGN_FAMILIES <= families
    assert set(GPU_FAMILIES) == DESIGN_GPU_FAMILIES and DESIGN_GPU_FAMILIES <= families
    assert "process_resident_memory_bytes" in families
    assert all(name.startswith(("reformer_", "process_")) for name in families)


class BrokenCollector:
    def collect(self) -> Iterator[Metric]:
        raise RuntimeError("collector exploded")


def test_a_failing_collector_is_skipped_and_logged(caplog: Any) -> None:
    metrics = ServiceMetrics()
    metrics.add_collector(BrokenCollector(), "broken")  # type: ignore[arg-type]
    text = metrics.render().decode()
    assert "reformer_requests_total" in text
    assert "collector exploded" in caplog.text


def test_a_failing_collector_does_not_fail_the_scrape_over_http(artifact: Any) -> None:
    with running_app(artifact) as client:
        client.app.state.service.metrics.add_collector(BrokenCollector(), "broken")
        r = client.get("/metrics")
        assert r.status_code == 200 and "reformer_queue_size" in r.text
        assert client.post("/embed", json={"inputs": "a"}).status_code == 200


def test_decode_cache_hook_sets_bytes_and_ratio() -> None:
    metrics = ServiceMetrics()
    metrics.set_decode_cache(allocated=256, capacity=1024)
    text = metrics.render().decode()
    assert 'reformer_decode_cache_bytes{state="allocated"} 256.0' in text
    assert 'reformer_decode_cache_bytes{state="capacity"} 1024.0' in text
    assert "reformer_decode_cache_usage_ratio 0.25" in text


def test_probes_are_not_requests_and_a_scrape_is_not_in_flight(artifact: Any) -> None:
    with running_app(artifact) as client:
        for path in ("/health", "/ready", "/metrics", "/metrics"):
            client.get(path)
        text = client.get("/metrics").text
    assert not re.search(r'reformer_request(s_total|_duration_seconds_count)\{route="/(metrics|health|ready)"', text)
    assert "reformer_inflight_requests 0.0" in text
