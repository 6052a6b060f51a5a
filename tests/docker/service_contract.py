"""What the service really exports and serves, read from the service's own code, so the deployment
files can be checked against it: metric families, route paths, the default port, the settings'
environment variables."""

from __future__ import annotations

import functools
import re

from service.settings import Settings

# A metric name in PromQL, a Grafana query or an adapter rule: the project's metrics all carry this prefix.
METRIC_NAME = re.compile(r"\breformer_[a-zA-Z0-9_]+")
SERIES_SUFFIXES = ("_bucket", "_sum", "_count")
ENV_PREFIX = "REFORMER_"


@functools.cache
def exported_metric_families() -> frozenset[str]:
    from service.observability.metrics import exported_metric_families as families

    return frozenset(families())


@functools.cache
def served_paths() -> frozenset[str]:
    """Every path the FastAPI app routes, read from the app without loading a model (the model loads in
    the lifespan, which is never entered here)."""
    from service.api.app import create_app

    app = create_app(Settings(), artifact=None)
    # Recent FastAPI keeps included routers as lazy wrappers without a `path` in app.routes; the OpenAPI
    # document lists their routes. A route hidden from the schema would be missing: that fails a test,
    # it never passes one wrongly.
    plain = {route.path for route in app.routes if isinstance(getattr(route, "path", None), str)}
    return frozenset(plain | set(app.openapi()["paths"]))


def default_port() -> int:
    return int(Settings.model_fields["port"].default)


def settings_env_names() -> frozenset[str]:
    return frozenset(ENV_PREFIX + name.upper() for name in Settings.model_fields)


def metric_names_in(text: str) -> set[str]:
    return set(METRIC_NAME.findall(text))


@functools.cache
def histogram_families() -> frozenset[str]:
    """The families that have _bucket/_sum/_count series, from the `# TYPE` lines of a fresh scrape."""
    from service.observability.metrics import ServiceMetrics

    text = ServiceMetrics().render().decode()
    typed = (line.split() for line in text.splitlines() if line.startswith("# TYPE "))
    return frozenset(fields[2] for fields in typed if fields[3] in ("histogram", "summary"))


def family_of(series_name: str) -> str:
    """The family a series belongs to: a histogram's _bucket/_sum/_count series name their family."""
    for suffix in SERIES_SUFFIXES:
        if series_name.endswith(suffix) and series_name[: -len(suffix)] in histogram_families():
            return series_name[: -len(suffix)]
    return series_name


def unknown_metrics(text: str) -> set[str]:
    """The reformer_* series named in `text` that the service does not export: names of no family, a
    gauge's made-up `_count`, or a histogram's bare family name (only its _bucket/_sum/_count exist)."""
    return {
        name
        for name in metric_names_in(text)
        if family_of(name) not in exported_metric_families() or name in histogram_families()
    }
