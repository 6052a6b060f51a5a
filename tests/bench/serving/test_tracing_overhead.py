"""bench/serving/tracing_overhead.py: the pooled overhead, the counts the server logs when its tracing stops,
and the span report's lost spans and missing request spans."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import bench.serving.tracing_overhead as bench
from bench.serving.otlp_receiver import OtlpReceiver
from service.observability.logs import JsonFormatter
from service.observability.tracing_export import SpanCounts, log_counts


def test_the_overhead_pools_each_servers_rounds() -> None:
    rounds = [{"server": "off", "tokens": 1000.0, "wall_s": 1.0}, {"server": "on", "tokens": 1000.0, "wall_s": 1.1},
              {"server": "on", "tokens": 1000.0, "wall_s": 0.9}, {"server": "off", "tokens": 1000.0, "wall_s": 1.5}]
    assert bench.summarize([]) is None  # --rounds 0: the traced prompts only
    summary = bench.summarize(rounds)
    assert summary is not None and summary["off_tokens_per_s"] == 800.0 and summary["on_tokens_per_s"] == 1000.0
    assert summary["overhead"] == -0.25 and summary["met"]
    slower = bench.summarize([{**r, "wall_s": 1.0 if r["server"] == "off" else 1.05} for r in rounds])
    assert slower is not None and slower["overhead"] == pytest.approx(1 - 1 / 1.05, abs=1e-4) and not slower["met"]


@pytest.mark.parametrize("ended, exported", [(12, 12), (12, 9)])
def test_the_counts_the_server_logs_are_read_back(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                  ended: int, exported: int) -> None:
    counts = SpanCounts()
    for _ in range(ended):
        counts.add_ended()
    counts.add_exported(exported)
    with caplog.at_level(logging.INFO, logger="service.tracing"):
        log_counts(counts)
    (record,) = caplog.records
    assert record.levelno == (logging.INFO if ended == exported else logging.ERROR)
    log = tmp_path / "on.log"
    log.write_text("not json\n" + JsonFormatter().format(record) + "\n")
    assert bench.tracing_counts(log) == {"ended": ended, "exported": exported}


def test_the_span_report_counts_lost_spans_and_requests_without_a_span() -> None:
    with OtlpReceiver() as receiver:
        # two traces as the exporter sends them: a request span (SERVER) and one child; a lone child span
        request = ExportTraceServiceRequest()
        spans = request.resource_spans.add().scope_spans.add().spans
        for trace, name, kind in ((b"a" * 16, "POST /generate", 2), (b"a" * 16, "queue", 1),
                                  (b"b" * 16, "queue", 1)):
            span = spans.add()
            span.trace_id, span.span_id, span.name, span.kind = trace, bytes(8), name, kind
        r = httpx.post(receiver.url + "/v1/traces", content=request.SerializeToString(),
                       headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 200
        report = bench.span_report(receiver, Counter({"POST /generate": 2}), {"ended": 5, "exported": 5})
    assert report["received"] == 3 and report["lost"] == 2
    assert report["most_spans_in_a_trace"] == 2 and report["traces"] == 2
    assert not report["every_request_has_its_span"]  # two sent, one request span received
    assert json.dumps(report)
