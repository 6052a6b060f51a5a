"""service/observability/tracing_export.py: the provider counts the spans ended and those its exporter took, and when
tracing stops the log says both: info when every span went out, an error naming the lost ones otherwise."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.observability.tracing import Tracing
from service.observability.tracing_export import counted_provider


class DownExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE


@pytest.mark.parametrize("exporter, exported, level", [
    pytest.param(InMemorySpanExporter(), 3, logging.INFO, id="all-exported"),
    pytest.param(DownExporter(), 0, logging.ERROR, id="export-failed"),
])
def test_the_spans_ended_and_exported_are_logged_when_tracing_stops(
        caplog: pytest.LogCaptureFixture, exporter: SpanExporter, exported: int, level: int) -> None:
    provider, counts = counted_provider(exporter, "reformer-test")
    tracing = Tracing(provider.get_tracer("test"), provider, counts)
    for name in ("request", "queue", "prefill"):
        tracing.tracer.start_span(name).end()
    with caplog.at_level(logging.INFO, logger="service.tracing"):
        tracing.shutdown()  # flushes the batch first
    assert (counts.ended, counts.exported, counts.lost) == (3, exported, 3 - exported)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("tracing stopped")]
    assert record.levelno == level
    assert (record.spans_ended, record.spans_exported) == (3, exported)  # type: ignore[attr-defined]
    if exported < 3:
        assert "3 lost" in record.getMessage()


def test_the_service_name_comes_from_the_variables_given() -> None:
    memory = InMemorySpanExporter()
    provider, _ = counted_provider(memory, "from-the-mapping")
    provider.get_tracer("test").start_span("x").end()
    provider.shutdown()
    (span,) = memory.get_finished_spans()
    assert span.resource.attributes["service.name"] == "from-the-mapping"
    default, _ = counted_provider(InMemorySpanExporter(), None)
    assert default.resource.attributes["service.name"] == "reformer-serve"
