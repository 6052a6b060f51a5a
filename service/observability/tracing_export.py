"""Where the spans go: the exporter the standard OTEL_* variables ask for, behind the SDK's batch processor, and
a count of the spans ended and of those the exporter took, so that spans lost on the way (the batch queue
full, an export that failed) show in the log when tracing stops.

OTEL_TRACES_EXPORTER `otlp` or `console`, or, with it unset, an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT /
..._TRACES_ENDPOINT) turn it on; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none keep it off. The SDK and
the OTLP exporter come with the `otel` extra; imported here only when tracing is on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("service.tracing")

DEFAULT_SERVICE_NAME = "reformer-serve"


def wanted(environ: Mapping[str, str]) -> str | None:
    """The exporter the OTEL_* variables ask for ("otlp" or "console"), or None for tracing off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return "otlp" if endpoint else None
    if "none" in names:
        return None
    for name in names:
        if name in ("otlp", "console"):
            return name
    log.error("OTEL_TRACES_EXPORTER=%s: only otlp, console and none are supported; tracing is off", ",".join(names))
    return None


def otlp_exporter(environ: Mapping[str, str]) -> Any:
    """The OTLP exporter for the protocol and endpoint the variables name (the SDK's defaults otherwise; its
    other settings, such as OTEL_EXPORTER_OTLP_HEADERS, it reads from the process environment itself)."""
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=traces or base)
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # the signal's own endpoint is used as given; the base endpoint gets the traces path, as the spec says
    endpoint = traces or (base.rstrip("/") + "/v1/traces" if base else None)
    return OTLPSpanExporter(endpoint=endpoint)


class SpanCounts:
    """Spans ended in this process and spans the exporter took; after a flush, the difference was lost (the
    batch queue was full, or an export failed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ended = 0
        self.exported = 0

    def add_ended(self) -> None:
        with self._lock:
            self.ended += 1

    def add_exported(self, n: int) -> None:
        with self._lock:
            self.exported += n

    @property
    def lost(self) -> int:
        return self.ended - self.exported


def counted_provider(exporter: Any, service_name: str | None) -> tuple[Any, SpanCounts]:
    """A TracerProvider that batches spans to `exporter` (the SDK's BatchSpanProcessor, its queue and batch
    sizes from the OTEL_BSP_* variables), and the counts of its spans ended and exported."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    counts = SpanCounts()

    class CountEnded(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            counts.add_ended()

    class CountExported(SpanExporter):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            result: SpanExportResult = self.inner.export(spans)
            if result == SpanExportResult.SUCCESS:
                counts.add_exported(len(spans))
            return result

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(self.inner.force_flush(timeout_millis))

    # named here, not left to the SDK, which would read OTEL_SERVICE_NAME from the process environment
    provider = TracerProvider(resource=Resource.create({"service.name": service_name or DEFAULT_SERVICE_NAME}))
    provider.add_span_processor(CountEnded())
    provider.add_span_processor(BatchSpanProcessor(CountExported(exporter)))
    return provider, counts


def log_counts(counts: SpanCounts) -> None:
    """What tracing sent, once it is flushed and stopped: an error if any span was lost."""
    extra = {"spans_ended": counts.ended, "spans_exported": counts.exported}
    if counts.lost:
        log.error("tracing stopped: %d spans ended, %d exported, %d lost (the batch queue was full or an export "
                  "failed: OTEL_BSP_MAX_QUEUE_SIZE)", counts.ended, counts.exported, counts.lost, extra=extra)
    else:
        log.info("tracing stopped: %d spans ended, all exported", counts.ended, extra=extra)
