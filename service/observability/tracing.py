"""OpenTelemetry spans for each request's life: the request itself (a server span whose parent is the W3C
`traceparent` the client sent), and under it, for every engine job the request queued, `admission`, `queue`,
`prefill`, `decode` (or `embed`) and `delivery` (from the job's end to the response's last byte): one span
each, whatever the prompt's length. A long prompt prefilled in slices between decode steps still makes one
`prefill` span, from its first slice's start to its last one's end; its attributes give the slice count,
the prompt's tokens, those found in the prefix cache, and the slices' total and longest time, and its first
PREFILL_SLICES_KEPT slices are events of it (service/jobs.py `PrefillTimings`, `Timings.cached_tokens`).

The engine only records timestamps on the job's Timings (service/jobs.py) and names the job to the request
that queued it (`note_job`); the spans are made here, from those timestamps, once the response is sent, so
no tracing code runs on the model's worker thread. Every tracing call is guarded: a tracer, span or
exporter that fails is logged, never the request's failure.

Off unless the standard OTEL_* variables ask for it (service/observability/tracing_export.py). The SDK and the
OTLP exporter
come with the `otel` extra (`pip install reformer-serve[otel]`); the exporter reads its endpoint, headers and
protocol from the same variables."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.jobs import Timings
from service.observability.tracing_export import SpanCounts, counted_provider, log_counts, otlp_exporter, wanted

log = logging.getLogger("service.tracing")

TRACER_NAME = "reformer-serve"


@dataclass
class RequestTrace:
    """What one request's spans are made from: the Timings of the engine jobs it queued."""

    jobs: list[Timings] = field(default_factory=list)


_current: ContextVar[RequestTrace | None] = ContextVar("reformer_request_trace", default=None)


def note_job(timings: Timings) -> None:
    """Engine hook (on the event loop, where the request queues its job): the job's Timings join the current
    request's trace. Outside a traced request, nothing."""
    trace = _current.get()
    if trace is not None:
        trace.jobs.append(timings)


class Tracing:
    """The tracer the middleware uses (None: off) and, when this module made the provider, the provider to
    flush and shut down with the app and the counts of the spans it ended and exported."""

    def __init__(self, tracer: Any = None, provider: Any = None, counts: SpanCounts | None = None) -> None:
        self.tracer = tracer
        self.provider = provider
        self.counts = counts

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def with_provider(cls, provider: Any) -> Tracing:
        """Spans through a given TracerProvider (tests pass one with an in-memory exporter)."""
        return cls(provider.get_tracer(TRACER_NAME))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Tracing:
        env = os.environ if environ is None else environ
        kind = wanted(env)
        if kind is None:
            return cls.off()
        try:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter() if kind == "console" else otlp_exporter(env)
            provider, counts = counted_provider(exporter, env.get("OTEL_SERVICE_NAME"))
        except ImportError as err:
            log.error("tracing asked for by OTEL_* variables, but %s is not installed (pip install "
                      "'reformer-serve[otel]'); tracing is off", err.name)
            return cls.off()
        except Exception as err:
            log.error("tracing could not be set up (%s); tracing is off", err)
            return cls.off()
        log.info("tracing on: %s exporter", kind)
        return cls(provider.get_tracer(TRACER_NAME), provider, counts)

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (only a provider this module made); log the counts."""
        if self.provider is not None:
            try:
                self.provider.shutdown()
            except Exception:
                log.exception("tracing shutdown failed")
        if self.counts is not None:
            log_counts(self.counts)


def _wall_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


def prefill_attributes(job: Timings) -> dict[str, Any]:
    """The `prefill` span's attributes (docs/DEPLOY.md, "Tracing")."""
    prefill = job.prefill
    return {
        "reformer.prefill.tokens": prefill.tokens,
        "reformer.prefill.cached_tokens": job.cached_tokens,
        "reformer.prefill.slices": prefill.slices,
        "reformer.prefill.slices_total_s": round(prefill.total_s, 6),
        "reformer.prefill.slice_longest_s": round(prefill.longest_s, 6),
    }


def job_spans(tracer: Any, parent: Any, job: Timings, response_end: float, offset_ns: int) -> None:
    """The child spans of one job, from its timestamps (those it never reached are left out): five at most."""
    from opentelemetry import trace

    context = trace.set_span_in_context(parent)

    def span(name: str, start: float | None, end: float | None, attributes: dict[str, Any] | None = None,
             events: Sequence[tuple[float, dict[str, Any]]] = ()) -> None:
        if start is None or end is None:
            return
        s = tracer.start_span(name, context=context, start_time=_wall_ns(start, offset_ns), attributes=attributes)
        for at, event_attributes in events:
            s.add_event("prefill.slice", event_attributes, timestamp=_wall_ns(at, offset_ns))
        s.end(end_time=_wall_ns(max(end, start), offset_ns))

    admitted = job.admitted if job.admitted is not None else job.enqueued
    span("admission", job.enqueued, admitted)
    span("queue", admitted, job.started if job.started is not None else job.finished)
    prefill = job.prefill
    if prefill.slices:
        events = [(began, {"reformer.prefill.slice": index, "reformer.prefill.slice_s": round(ended - began, 6)})
                  for index, (began, ended) in enumerate(prefill.first_slices)]
        span("prefill", prefill.began, prefill.ended, prefill_attributes(job), events)
    elif prefill.tokens and job.first_token is not None:
        # a generation without a prefill call of its own: its prompt's state was reused whole (a prefix-cache
        # hit, or the prefill of an identical prompt), from its start to its first token, 0 slices
        span("prefill", job.started, job.first_token, prefill_attributes(job))
    if job.first_token is not None:
        # a generation dropped because its client left never finishes: its decode ran until the response ended
        structured = {"reformer.structured.mask_s": round(job.mask_s, 6),
                      "reformer.structured.mask_steps": job.mask_steps} if job.mask_steps else None
        span("decode", job.first_token, job.finished if job.finished is not None else response_end, structured)
    elif not prefill.slices:
        span("embed", job.started, job.finished)
    span("delivery", job.finished, response_end)


class TracingMiddleware:
    """The request span around the app, its parent taken from the request's `traceparent`; the job spans
    made once the response's last byte is sent (or the request failed)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing
        self._propagator: Any = None
        if tracing.enabled:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    def _start(self, scope: Scope) -> Any:
        from opentelemetry.trace import SpanKind

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = self._propagator.extract(carrier=headers)
        method, path = scope.get("method", ""), scope.get("path", "")
        return self.tracing.tracer.start_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path})

    def _finish(self, span: Any, trace: RequestTrace, status: int | None, response_end: float,
                error: BaseException | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        offset_ns = time.time_ns() - int(time.monotonic() * 1e9)
        for job in trace.jobs:
            job_spans(self.tracing.tracer, span, job, response_end, offset_ns)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.record_exception(error)
        if error is not None or (status is not None and status >= 500):
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tracing.enabled:
            await self.app(scope, receive, send)
            return
        try:
            span = self._start(scope)
        except Exception:
            log.exception("tracing: the request span could not start; the request goes on untraced")
            await self.app(scope, receive, send)
            return
        trace = RequestTrace()
        token = _current.set(trace)
        status: int | None = None
        response_end = time.monotonic()

        async def traced_send(message: Message) -> None:
            nonlocal status, response_end
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_end = time.monotonic()

        error: BaseException | None = None
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _current.reset(token)
            if error is not None:
                response_end = time.monotonic()
            try:
                self._finish(span, trace, status, response_end, error)
            except Exception:
                log.exception("tracing: the request's spans could not be recorded")
