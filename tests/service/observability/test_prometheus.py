"""A real Prometheus (Debian's `prometheus` package; scripts/test-deps.sh installs it) scraping a live service every
second on loopback, queried through its HTTP API: the defects only a real scraper shows stay fixed.

- labelled counters exist at zero before their first event, so `increase()` counts the first 422;
- /metrics, /health and /ready are not in the request series, and the in-flight gauge reads 0 while scraped;
- with every batch of 1 the dashboard's p95 batch size reads 1;
- the prometheus-adapter values name only queue kinds the service exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.server_process import free_port
from tests.service.conftest import REPO, ServerProcess

SCRAPE_S = 1.0


def binary(name: str) -> str:
    """A Prometheus binary; its absence fails (never skips) the test, naming what to install."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is missing: install Debian's `prometheus` package "
                    f"(scripts/test-deps.sh installs it; `make test` runs it first)")
    return found


class Prometheus:
    def __init__(self, target: str, workdir: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
            "scrape_configs": [{"job_name": "reformer-serve", "scrape_timeout": "900ms",
                                "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address={self.url[len('http://'):]}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5.0)
        assert r.status_code == 200, r.text
        return list(r.json()["data"]["result"])

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    def wait_scrapes(self, count: int = 3) -> None:
        """Let `count` more scrapes land (and the first one at all)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()}")
            try:
                # Prometheus answers 503 to queries until its storage is open: wait for /-/ready first.
                ready = httpx.get(self.url + "/-/ready", timeout=5.0).status_code == 200
                if ready and self.query('up{job="reformer-serve"} == 1'):
                    time.sleep(count * SCRAPE_S + 0.5)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus never scraped the service:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def scraped(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess,
                                                                                              Prometheus]]:
    binary("prometheus")
    server = server_factory(backend="torch")
    prometheus = Prometheus(f"127.0.0.1:{server.port}", tmp_path_factory.mktemp("prometheus"))
    try:
        prometheus.wait_scrapes(2)
        yield server, prometheus
    finally:
        prometheus.stop()


def test_idle_service_as_prometheus_sees_it(scraped: tuple[ServerProcess, Prometheus]) -> None:
    server, prometheus = scraped
    names = set(httpx.get(prometheus.url + "/api/v1/label/__name__/values", timeout=5).json()["data"])
    for family in ("reformer_requests_total", "reformer_request_duration_seconds_bucket", "reformer_queue_size",
                   "reformer_batch_size_bucket", "reformer_decode_cache_bytes", "reformer_model_info"):
        assert family in names
    # Scraped many times already, yet no probe is a request and the scrape is not in flight.
    assert prometheus.query('reformer_requests_total{route=~"/metrics|/health|/ready"}') == []
    assert prometheus.query('reformer_request_duration_seconds_count{route=~"/metrics|/health|/ready"}') == []
    assert prometheus.value("reformer_inflight_requests") == 0
    # Known label sets exist at zero before their first event.
    rejected = prometheus.query("reformer_requests_rejected_total")
    reasons = {r["metric"]["reason"]: float(r["value"][1]) for r in rejected}
    assert reasons == {"queue_full": 0, "timeout": 0, "unavailable": 0}
    assert prometheus.value('reformer_requests_total{route="/embed",status="422"}') == 0
    assert prometheus.value('reformer_requests_total{route="/generate",status="429"}') == 0


def test_first_events_are_counted_by_increase(scraped: tuple[ServerProcess, Prometheus]) -> None:
    server, prometheus = scraped
    for _ in range(3):
        assert httpx.post(server.url + "/embed", json={"inputs": "a b c"}, timeout=30).status_code == 200
    for _ in range(2):
        assert httpx.post(server.url + "/embed", json={"wrong": 1}, timeout=30).status_code == 422
    prometheus.wait_scrapes(3)
    # The zero sample before the first 422 lets increase() see both (extrapolation makes it about 2).
    assert prometheus.value('increase(reformer_requests_total{route="/embed",status="422"}[1m])') >= 1.5
    assert prometheus.value('increase(reformer_requests_total{route="/embed",status="200"}[1m])') >= 2.5
    # Every embed batch held one request: the dashboard's p95 reads 1 (it read 0.95 with bounds 1, 2, ...).
    p95 = prometheus.value('histogram_quantile(0.95, sum by (le) (rate(reformer_batch_size_bucket{kind="embed"}[1m])))')
    assert round(p95, 2) == 1.0
    assert prometheus.value('sum(rate(reformer_request_duration_seconds_count{route="/embed"}[1m]))') > 0


def test_adapter_values_name_only_exported_queue_kinds(scraped: tuple[ServerProcess, Prometheus]) -> None:
    _, prometheus = scraped
    exported = {r["metric"]["kind"] for r in prometheus.query("reformer_queue_size")}
    text = (REPO / "docker/k8s/prometheus-adapter/values.yaml").read_text()
    named = re.search(r"one series per kind \(([^)]*)\)", text)
    assert named is not None, "the values comment should name the queue kinds"
    assert {kind.strip() for kind in named[1].split(",")} == exported
