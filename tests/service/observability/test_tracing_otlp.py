"""A request's trace as a collector receives it: exported over real OTLP/HTTP protobuf (the SDK's exporter,
from the OTEL_* variables) to a receiver on loopback that decodes `ExportTraceServiceRequest`
(bench/serving/otlp_receiver.py). One span per stage under the request span, whatever the prompt's
length: a prompt prefilled in 11,000 slices (more than the SDK's batch queue of 2,048 spans) still makes
six spans, its slices summed in the `prefill` span's attributes and the first few kept as its events."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

import service.engine.generation_steps as steps_module
from bench.serving.otlp_receiver import OtlpReceiver, ReceivedSpan
from service.api.app import create_app
from service.engine.runner import ModelRunner
from service.jobs import PREFILL_SLICES_KEPT
from service.observability.tracing import Tracing
from service.settings import Settings
from tests.service.helpers import wait_ready

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
STAGES = ["admission", "queue", "prefill", "decode", "delivery"]
MOST_SPANS = 8  # a request's trace, at most (issue 57): here 6, the request and its five stages


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def export_requests(artifact: Any, receiver: OtlpReceiver, send: Callable[[TestClient], Any]
                    ) -> Any:
    """`send` against a server tracing to `receiver` as the OTEL_* variables set it up; the app is shut down
    before this returns, which flushes the batch processor, so every span has reached the receiver."""
    tracing = Tracing.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                                        "OTEL_SERVICE_NAME": "reformer-test"})
    assert tracing.enabled
    settings = Settings(prefill="one-piece", max_new_tokens=8, max_input_tokens=1900)  # type: ignore[call-arg]
    app = create_app(settings, artifact, tracing=tracing)
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(app.state.service)
        response = send(client)
    assert receiver.rejected == []
    assert tracing.counts is not None and tracing.counts.ended == len(receiver.spans())
    return response


def generate(prompt: str) -> Callable[[TestClient], Any]:
    def send(client: TestClient) -> Any:
        r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 4, "ignore_eos": True}},
                        headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200, r.text
        return r
    return send


def the_trace(receiver: OtlpReceiver) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The client's trace: its request span (checked to be the server span under the client's traceparent)
    and the spans under it, in start order."""
    traces = receiver.traces()
    assert list(traces) == [TRACE_ID]
    spans = traces[TRACE_ID]
    assert len(spans) <= MOST_SPANS
    roots = [s for s in spans if s.parent_span_id == PARENT_ID]
    assert len(roots) == 1
    root = roots[0]
    assert root.name == "POST /generate" and root.kind == SERVER
    assert root.attributes["http.response.status_code"] == 200
    assert root.resource["service.name"] == "reformer-test"
    children = [s for s in spans if s is not root]
    assert all(s.parent_span_id == root.span_id for s in children)
    for s in spans:
        assert s.start_ns <= s.end_ns
    for s in children:
        assert root.start_ns <= s.start_ns and s.end_ns <= root.end_ns
    return root, children


def test_a_sliced_prompt_is_one_prefill_span_with_its_slices_as_attributes(
        artifact: Any, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 64)  # the tiny model's 1,500 tokens: sliced
    prompt = "The Reformer attends over long documents. " * 35  # 1,505 bytes: tokens, for the byte tokenizer
    response = export_requests(artifact, receiver, generate(prompt))
    _, children = the_trace(receiver)
    assert [s.name for s in children] == STAGES
    for before, after in zip(children, children[1:]):
        assert before.end_ns <= after.start_ns + 1_000  # in order; rounding of the clock offset aside
    prefill = children[2]
    attributes = prefill.attributes
    assert attributes["reformer.prefill.tokens"] == int(response.headers["x-prompt-tokens"]) == len(prompt)
    assert attributes["reformer.prefill.cached_tokens"] == 0
    slices = attributes["reformer.prefill.slices"]
    assert slices > 1
    total, longest = attributes["reformer.prefill.slices_total_s"], attributes["reformer.prefill.slice_longest_s"]
    assert 0 < longest <= total <= (prefill.end_ns - prefill.start_ns) / 1e9 + 1e-6
    # the first slices, one event each, in order, inside the span
    assert len(prefill.events) == min(slices, PREFILL_SLICES_KEPT)
    assert [e[2]["reformer.prefill.slice"] for e in prefill.events] == list(range(len(prefill.events)))
    assert all(e[0] == "prefill.slice" and prefill.start_ns <= e[1] <= prefill.end_ns for e in prefill.events)
    assert all(0 <= e[2]["reformer.prefill.slice_s"] <= longest for e in prefill.events)


FORCED_SLICES = 11_000  # a 500K-token prompt's (issue 57), past the SDK's batch queue of 2,048 spans


def test_thousands_of_prefill_slices_still_make_six_spans(
        artifact: Any, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a 500K-token prompt's ~11,000 slices would do, on the tiny model: each prefill runs FORCED_SLICES
    empty slices before its real ones, and every one of them is a slice of the engine's loop."""
    real = ModelRunner.prefill_slices

    def many_slices(self: ModelRunner, prompts: Any, reserve: Any) -> Generator[None, None, Any]:
        for _ in range(FORCED_SLICES):
            yield
        return (yield from real(self, prompts, reserve))

    monkeypatch.setattr(ModelRunner, "prefill_slices", many_slices)
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 64)
    export_requests(artifact, receiver, generate("a long prompt, " * 20))
    _, children = the_trace(receiver)
    assert [s.name for s in children] == STAGES
    prefill = children[2]
    assert prefill.attributes["reformer.prefill.slices"] > FORCED_SLICES
    assert len(prefill.events) == PREFILL_SLICES_KEPT
    assert len(receiver.spans()) == 1 + len(STAGES)


def test_an_embedding_exports_its_four_stages(artifact: Any, receiver: OtlpReceiver) -> None:
    def embed(client: TestClient) -> Any:
        r = client.post("/embed", json={"inputs": ["one", "two"]}, headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200, r.text
        return r

    export_requests(artifact, receiver, embed)
    traces = receiver.traces()
    root = next(s for s in traces[TRACE_ID] if s.parent_span_id == PARENT_ID)
    assert root.name == "POST /embed"
    assert [s.name for s in traces[TRACE_ID] if s is not root] == ["admission", "queue", "embed", "delivery"]


def test_a_prefix_cache_hit_is_a_prefill_span_of_cached_tokens_and_no_slices(artifact: Any,
                                                                             receiver: OtlpReceiver) -> None:
    prompt = "The miller's daughter kept the ledger of every sack the river brought. " * 5  # 355 tokens
    second_trace = "0af7651916cd43dd8448eb211c80319c"

    def twice(client: TestClient) -> Any:
        generate(prompt)(client)  # prefilled, then kept in the prefix cache
        r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 4, "details": True}},
                        headers={"traceparent": f"00-{second_trace}-{PARENT_ID}-01"})
        assert r.status_code == 200, r.text
        assert r.json()["details"]["cached_tokens"] == len(prompt)
        return r

    export_requests(artifact, receiver, twice)
    first, second = receiver.traces()[TRACE_ID], receiver.traces()[second_trace]
    (cold,) = [s for s in first if s.name == "prefill"]
    (hit,) = [s for s in second if s.name == "prefill"]
    assert [s.name for s in second if s.parent_span_id != PARENT_ID] == STAGES
    assert cold.attributes["reformer.prefill.slices"] == 1 and cold.attributes["reformer.prefill.cached_tokens"] == 0
    assert hit.attributes["reformer.prefill.slices"] == 0 and hit.events == []
    assert hit.attributes["reformer.prefill.tokens"] == hit.attributes["reformer.prefill.cached_tokens"] == len(prompt)
