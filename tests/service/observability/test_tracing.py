"""OpenTelemetry spans of a request's life (SDK in-memory exporter): the request span under the client's
`traceparent`, and admission, queue, prefill (one span, however many slices), decode and delivery under it;
tracing on when the OTEL_* variables ask, off otherwise; a failing tracer, span or exporter never fails the
request. The export over OTLP to a receiver: tests/service/observability/test_tracing_otlp.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import service.engine.generation_steps as steps_module
from model.sampling import SamplingParams
from service.api.app import create_app
from service.engine.core import Engine, EngineConfig
from service.jobs import PREFILL_SLICES_KEPT, GenerationSpec, Timings
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import Tracing, job_spans
from service.settings import Settings
from tests.service.helpers import wait_ready

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def traced_client(artifact: Any, tracing: Tracing) -> Iterator[TestClient]:
    app = create_app(Settings(max_new_tokens=8, max_input_tokens=256), artifact, tracing=tracing)  # type: ignore[call-arg]
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(app.state.service)
        yield client


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def client(artifact: Any, exporter: InMemorySpanExporter) -> Iterator[TestClient]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield from traced_client(artifact, Tracing.with_provider(provider))


def spans_of(exporter: InMemorySpanExporter, path: str) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The last request span of `path` and its children, in start order."""
    spans = list(exporter.get_finished_spans())
    request = [s for s in spans if s.name == f"POST {path}"][-1]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id]
    return request, sorted(children, key=lambda s: (s.start_time or 0, s.end_time or 0))


def test_a_completion_is_traced_from_admission_to_delivery(client: TestClient,
                                                           exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True},
                    headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    request, children = spans_of(exporter, "/v1/completions")
    assert request.kind == SpanKind.SERVER
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert request.parent is not None and format(request.parent.span_id, "016x") == PARENT_ID
    assert request.attributes is not None and request.attributes["http.response.status_code"] == 200
    assert [s.name for s in children] == ["admission", "queue", "prefill", "decode", "delivery"]
    for before, after in zip(children, children[1:]):
        assert before.end_time is not None and after.start_time is not None
        assert before.start_time <= after.start_time
    for span in children:
        assert span.context.trace_id == request.context.trace_id
        assert span.start_time is not None and span.end_time is not None and span.start_time <= span.end_time
        assert request.start_time is not None and request.end_time is not None
        assert request.start_time <= span.start_time and span.end_time <= request.end_time


def test_each_prompt_of_a_request_gets_its_own_spans(client: TestClient, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    r = client.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    request, children = spans_of(exporter, "/v1/completions")
    assert request.parent is None  # no traceparent: a new trace
    assert sorted(s.name for s in children).count("queue") == 2


def test_an_embedding_is_traced_without_decode(client: TestClient, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    assert client.post("/embed", json={"inputs": "hello"}).status_code == 200
    _, children = spans_of(exporter, "/embed")
    assert [s.name for s in children] == ["admission", "queue", "embed", "delivery"]


def test_a_refused_request_has_only_its_own_span(client: TestClient, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000}).status_code // 100 == 4
    request, children = spans_of(exporter, "/v1/completions")
    assert children == [] and request.attributes is not None
    assert request.attributes["http.response.status_code"] // 100 == 4


def test_a_sliced_prefill_is_one_span_its_slices_summed_and_the_first_ones_events() -> None:
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    parent = tracer.start_span("request")
    job = Timings(enqueued=10.0, admitted=10.1, started=10.5, first_token=13.0, finished=14.0)
    job.prefill.tokens = 300
    slices = [(10.5, 11.0), (11.2, 12.0), (12.1, 12.9)]
    for _ in range(PREFILL_SLICES_KEPT):  # many more than are kept: only counted and summed past the first ones
        slices.append((12.9, 12.9))
    for began, ended in slices:
        job.prefill.add_slice(began, ended)
    job_spans(tracer, parent, job, response_end=14.5, offset_ns=0)
    spans = sorted(memory.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert [s.name for s in spans] == ["admission", "queue", "prefill", "decode", "delivery"]
    prefill = spans[2]
    assert (prefill.start_time, prefill.end_time) == (10_500_000_000, 12_900_000_000)
    assert prefill.attributes == {"reformer.prefill.tokens": 300, "reformer.prefill.cached_tokens": 0,
                                  "reformer.prefill.slices": len(slices),
                                  "reformer.prefill.slices_total_s": pytest.approx(2.1),
                                  "reformer.prefill.slice_longest_s": pytest.approx(0.8)}
    assert len(prefill.events) == PREFILL_SLICES_KEPT
    assert [(e.timestamp, (e.attributes or {})["reformer.prefill.slice"]) for e in prefill.events[:3]] == [
        (10_500_000_000, 0), (11_200_000_000, 1), (12_100_000_000, 2)]
    assert [(e.attributes or {})["reformer.prefill.slice_s"] for e in prefill.events[:3]] == [
        pytest.approx(0.5), pytest.approx(0.8), pytest.approx(0.8)]


def test_a_prefix_cache_hit_shows_on_the_prefill_span() -> None:
    """`cached_tokens`, which the prefix cache sets on the job's Timings, is the span's attribute."""
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    job = Timings(enqueued=1.0, admitted=1.0, started=1.0, first_token=2.0, finished=2.0)
    job.prefill.tokens, job.cached_tokens = 1000, 768
    job.prefill.add_slice(1.0, 1.5)
    job_spans(tracer, tracer.start_span("request"), job, response_end=2.0, offset_ns=0)
    (prefill,) = [s for s in memory.get_finished_spans() if s.name == "prefill"]
    assert prefill.attributes is not None and prefill.attributes["reformer.prefill.cached_tokens"] == 768


def test_a_prompt_reused_whole_still_has_its_prefill_span() -> None:
    """A generation with no prefill call of its own (its prompt's state all from the prefix cache): the
    prefill span runs from its start to its first token, with 0 slices."""
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    job = Timings(enqueued=1.0, admitted=1.0, started=1.25, first_token=1.5, finished=2.0)
    job.prefill.tokens = job.cached_tokens = 1000
    job_spans(tracer, tracer.start_span("request"), job, response_end=2.0, offset_ns=0)
    spans = sorted(memory.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert [s.name for s in spans] == ["admission", "queue", "prefill", "decode", "delivery"]
    assert (spans[2].start_time, spans[2].end_time) == (1_250_000_000, 1_500_000_000)
    assert spans[2].attributes is not None and spans[2].attributes["reformer.prefill.slices"] == 0
    assert spans[2].attributes["reformer.prefill.cached_tokens"] == 1000


def test_a_generation_whose_client_left_decodes_until_the_response_ended() -> None:
    """Dropped when its client went away, it never finishes: its decode span ends with the response, and it
    has no delivery."""
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    job = Timings(enqueued=1.0, admitted=1.0, started=1.0, first_token=1.5, finished=None)
    job.prefill.tokens = 10
    job.prefill.add_slice(1.0, 1.25)
    job_spans(tracer, tracer.start_span("request"), job, response_end=3.0, offset_ns=0)
    spans = sorted(memory.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert [s.name for s in spans] == ["admission", "queue", "prefill", "decode"]
    assert (spans[3].start_time, spans[3].end_time) == (1_500_000_000, 3_000_000_000)


class FailingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise RuntimeError("the collector is down")


class FailingTracer:
    def __init__(self, fail_on: str) -> None:
        self.fail_on = fail_on
        self.inner = TracerProvider().get_tracer("inner")

    def start_span(self, name: str, **kwargs: Any) -> Any:
        if self.fail_on == "start":
            raise RuntimeError("tracer broken")
        span = self.inner.start_span(name, **kwargs)
        if self.fail_on == "end":
            def broken_end(end_time: int | None = None) -> None:
                raise RuntimeError("span broken")
            span.end = broken_end  # type: ignore[method-assign]
        return span


@pytest.mark.parametrize("tracing", [
    pytest.param(lambda: Tracing(FailingTracer("start")), id="tracer-fails-to-start-spans"),
    pytest.param(lambda: Tracing(FailingTracer("end")), id="spans-fail-to-end"),
    pytest.param(lambda: Tracing.with_provider(_provider_with(FailingExporter())), id="exporter-fails"),
])
def test_a_failing_tracer_span_or_exporter_never_fails_the_request(artifact: Any, tracing: Any) -> None:
    for client in traced_client(artifact, tracing()):
        plain = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert plain.status_code == 200, plain.text
        streamed = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True},
                               headers={"traceparent": TRACEPARENT})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert client.post("/embed", json={"inputs": "abc"}).status_code == 200


def _provider_with(exporter: SpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.mark.parametrize("environ, on", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, False),
])
def test_the_otel_variables_turn_tracing_on_or_off(environ: dict[str, str], on: bool) -> None:
    tracing = Tracing.from_environment(environ)
    assert tracing.enabled is on
    tracing.shutdown()


def test_the_engine_records_each_prefill_slice_of_a_long_prompt(artifact: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt arriving while a stream decodes is prefilled in slices between decode steps: the job's
    PrefillTimings count and sum them and keep the first ones, in order, between its admission and its first
    token."""
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    engine = Engine(artifact.model, artifact.tokenizer, backend=None,  # type: ignore[arg-type]
                    device=None, config=EngineConfig(warmup=False, prefill_budget_ms=0.0), metrics=ServiceMetrics())
    engine.start()

    async def long_prompt_while_streaming() -> Timings:
        stream = engine.generate(GenerationSpec([5, 6, 7], SamplingParams(), 200, stop_on_eos=False))
        await stream.next_event()
        long = engine.generate(GenerationSpec([5 + i % 200 for i in range(300)], SamplingParams(), 2,
                                              stop_on_eos=False))
        while (await long.next_event()).finish is None:
            pass
        while (await stream.next_event()).finish is None:
            pass
        return long.timings  # type: ignore[no-any-return]

    try:
        timings = asyncio.run(long_prompt_while_streaming())
    finally:
        engine.stop()
    prefill = timings.prefill
    assert prefill.tokens == 300 and timings.cached_tokens == 0
    assert prefill.slices > 1 and len(prefill.first_slices) == min(prefill.slices, PREFILL_SLICES_KEPT)
    assert prefill.began is not None and prefill.ended is not None
    assert timings.admitted is not None and timings.enqueued <= timings.admitted <= prefill.began
    kept = prefill.first_slices
    assert kept[0][0] == prefill.began
    for (began, ended), (next_began, _) in zip(kept, kept[1:]):
        assert began <= ended <= next_began
    assert 0 < prefill.longest_s <= prefill.total_s <= prefill.ended - prefill.began
    assert timings.first_token is not None and prefill.ended <= timings.first_token
