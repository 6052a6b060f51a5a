"""docker/compose.yaml, docker/prometheus.yml, docker/alerts.yml and the Grafana provisioning parse,
point at each other, and name only metrics, ports, paths and settings the service really has."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from service.settings import Settings
from tests.docker import service_contract as contract
from tests.docker.conftest import DOCKER, REPO, load_yaml

GRAFANA = DOCKER / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "reformer-serve.json"
URL = re.compile(r"http://(?P<host>[^:/'\"]+):(?P<port>\d+)(?P<path>/[^'\" ]*)")

# What issue 5 asks the dashboard to show, each as the metric a panel must plot for it.
DASHBOARD_TOPICS = {
    "request rate": "reformer_requests_total",
    "latency quantiles": "reformer_request_duration_seconds_bucket",
    "queue size": "reformer_queue_size",
    "batch size": "reformer_batch_size_sum",
    "tokens/s": "reformer_generated_tokens_total",
    "GPU memory": "reformer_gpu_memory_allocated_bytes",
}


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Bind mounts of a compose service as {container path: host path relative to docker/}."""
    binds = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            binds[target] = source
    return binds


def container_port(compose: dict[str, Any]) -> int:
    (mapping,) = compose["services"]["reformer"]["ports"]
    return int(mapping.split(":")[-1])


def test_service_is_the_image_on_the_gpu(compose: dict[str, Any]) -> None:
    service = compose["services"]["reformer"]
    build = service["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == REPO / "Dockerfile"
    assert container_port(compose) == contract.default_port()
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert set(service["environment"]) <= contract.settings_env_names()
    assert service["environment"]["REFORMER_DEVICE"] == "cuda"
    health = URL.search(" ".join(service["healthcheck"]["test"]))
    assert health is not None
    assert int(health["port"]) == contract.default_port() and health["path"] in contract.served_paths()
    # docker sends SIGKILL after stop_grace_period: it must outlast the service's drain.
    grace = float(service["environment"]["REFORMER_GRACE_PERIOD_S"])
    assert float(service["stop_grace_period"].rstrip("s")) > grace


def test_service_environment_is_settings_the_service_accepts(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    environment = compose["services"]["reformer"]["environment"]
    # A key with no value is passed through from the shell; an empty string would be a (blank) API key.
    assert "" not in environment.values()
    for key, value in environment.items():
        if value is not None:
            monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("REFORMER_API_KEY", raising=False)
    settings = Settings()  # validates every value as the service will at start-up
    assert settings.device == "cuda" and settings.api_key is None


def test_bind_mounts_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for source in mounts(service).values():
            assert (DOCKER / source).exists(), f"{name} mounts missing {source}"


def test_prometheus_scrapes_the_service(compose: dict[str, Any]) -> None:
    config = load_yaml(DOCKER / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["metrics_path"] in contract.served_paths()
    (static,) = job["static_configs"]
    (target,) = static["targets"]
    host, port = target.split(":")
    assert host in compose["services"] and host == "reformer"
    assert int(port) == container_port(compose)
    prometheus_mounts = mounts(compose["services"]["prometheus"])
    for rule_file in config["rule_files"]:
        assert rule_file in prometheus_mounts, f"{rule_file} is not mounted into the Prometheus container"
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["services"]["prometheus"]["command"]
    assert prometheus_mounts["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"


def test_alert_rules_name_exported_metrics() -> None:
    groups = load_yaml(DOCKER / "alerts.yml")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules
    for rule in rules:
        named = contract.metric_names_in(rule["expr"])
        # `up` is Prometheus' own per-target series; every other rule is about the service's metrics.
        assert named or rule["expr"].startswith("up{"), rule["alert"]
        assert contract.unknown_metrics(rule["expr"]) == set(), rule["alert"]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana_mounts = mounts(compose["services"]["grafana"])
    provisioning = Path(grafana_mounts["/etc/grafana/provisioning"])
    assert (DOCKER / provisioning).resolve() == GRAFANA / "provisioning"
    (datasource,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    url = re.fullmatch(r"http://(\w+):(\d+)", datasource["url"])
    assert url is not None and url[1] in compose["services"] and url[1] == "prometheus"
    (provider,) = load_yaml(GRAFANA / "provisioning" / "dashboards" / "reformer-serve.yaml")["providers"]
    dashboards_in_container = provider["options"]["path"]
    assert (DOCKER / grafana_mounts[dashboards_in_container]).resolve() == DASHBOARD.parent
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home) == PurePosixPath(dashboards_in_container) / DASHBOARD.name

    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]


def test_dashboard_shows_every_topic_with_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    plotted: set[str] = set()
    for panel in panels:
        exprs = [target["expr"] for target in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            named = contract.metric_names_in(expr)
            assert named, f"{panel['title']}: {expr}"
            assert contract.unknown_metrics(expr) == set(), panel["title"]
            plotted |= named
    missing = {topic for topic, metric in DASHBOARD_TOPICS.items() if metric not in plotted}
    assert not missing
    for variable in dashboard["templating"]["list"]:
        assert contract.unknown_metrics(variable["definition"]) == set()


def test_dashboard_panels_fit_the_grid_without_overlapping() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]  # Grafana's grid is 24 columns wide
        columns, rows = range(box["x"], box["x"] + box["w"]), range(box["y"], box["y"] + box["h"])
        covered = {(x, y) for x in columns for y in rows}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
