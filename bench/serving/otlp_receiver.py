"""A plain OTLP/HTTP trace receiver on loopback: what a collector sees of the service's spans. It decodes each
POST to /v1/traces as an `ExportTraceServiceRequest` (protobuf, opentelemetry-proto; gzip-compressed
bodies too), keeps every span, and answers an empty `ExportTraceServiceResponse`. The tracing benchmark
(bench/serving/tracing_overhead.py) and the tracing test
(tests/service/observability/test_tracing_otlp.py) export to it.

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        ...
        spans = receiver.spans()
"""

from __future__ import annotations

import gzip
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver decoded it (ids as lowercase hex; `parent_span_id` empty for a root)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 is SERVER
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time in ns, attributes)
    resource: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver:
    """The receiver on a free loopback port (`url` is what OTEL_EXPORTER_OTLP_ENDPOINT takes) until `stop`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0  # export requests decoded
        self.rejected: list[str] = []  # why a POST was not decoded (a wrong path, a body that is not OTLP)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the handler's name is http.server's
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding", "") == "gzip":
                    body = gzip.decompress(body)
                status = receiver._receive(self.path, self.headers.get("content-type", ""), body)
                payload = ExportTraceServiceResponse().SerializeToString() if status == 200 else b""
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def _receive(self, path: str, content_type: str, body: bytes) -> int:
        if path != TRACES_PATH or content_type != "application/x-protobuf":
            with self._lock:
                self.rejected.append(f"{path} ({content_type})")
            return 404 if path != TRACES_PATH else 415
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as err:  # a body that is not the message: the exporter's bug, recorded for the test
            with self._lock:
                self.rejected.append(f"undecodable body: {err}")
            return 400
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        name=s.name, kind=int(s.kind), start_ns=int(s.start_time_unix_nano),
                        end_ns=int(s.end_time_unix_nano), attributes=_attributes(s.attributes),
                        events=[(e.name, int(e.time_unix_nano), _attributes(e.attributes)) for e in s.events],
                        resource=resource))
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1
        return 200

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """The spans by trace id, each trace's in start order."""
        by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for span in self.spans():
            by_trace[span.trace_id].append(span)
        return {t: sorted(spans, key=lambda s: (s.start_ns, s.end_ns)) for t, spans in by_trace.items()}

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
