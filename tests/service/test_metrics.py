"""Metrics: every family documented for dashboards exists, and a failing collector never breaks a scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from service.metrics import GPU_FAMILIES, ServiceMetrics, exported_metric_families
from tests.service.helpers import running_app

DESIGN_FAMILIES = {
    "reformer_requests_total", "reformer_requests_rejected_total", "reformer_prompt_tokens_total",
    "reformer_generated_tokens_total", "reformer_request_duration_seconds", "reformer_request_queue_seconds",
    "reformer_request_inference_seconds", "reformer_time_to_first_token_seconds",
    "reformer_inter_token_latency_seconds", "reformer_input_tokens", "reformer_batch_size", "reformer_batch_tokens",
    "reformer_queue_size", "reformer_inflight_requests", "reformer_model_info", *GPU_FAMILIES,
}


def test_exported_families_cover_design_section_6() -> None:
    families = exported_metric_families()
    assert DESIGN_FAMILIES <= families
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
