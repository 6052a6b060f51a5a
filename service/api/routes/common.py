"""What the thin routers share: the service state dependency, disconnect watching, timing headers, SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from service.api.protocol import ErrorResponse, Limits, OpenAIErrorResponse
from service.api.state import ServiceState
from service.engine.admission import Reservation
from service.engine.core import Engine
from service.errors import Unavailable
from service.jobs import Timings

T = TypeVar("T")

# Status code of a response nobody will read: the client closed the connection (nginx's convention).
CLIENT_CLOSED = 499


def get_state(request: Request) -> ServiceState:
    return request.app.state.service  # type: ignore[no-any-return]


State = Annotated[ServiceState, Depends(get_state)]


def reservation_of(request: Request) -> Reservation | None:
    """The queue place the availability middleware reserved for this request (None off the queued routes)."""
    reservation = getattr(request.state, "reservation", None)
    return reservation if isinstance(reservation, Reservation) else None


def ready_parts(state: ServiceState) -> tuple[Engine, Limits, Any]:
    """The engine, limits and tokenizer, or 503 if the model is not there."""
    if state.engine is None or state.limits is None or state.artifact is None:
        raise Unavailable("the model is loading")
    return state.engine, state.limits, state.artifact.tokenizer


class ClientDisconnected(Exception):
    pass


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` unless the client goes away first; then cancel it (the engine drops the work)."""
    work = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def tokenized(request: Request, state: ServiceState, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the tokenize threads (service/text/tokenizing.py), unless the client leaves first: then
    ClientDisconnected, and a text still waiting for a thread is never tokenized."""
    return await until_disconnected(request, state.tokenizing.run(fn, *args))


def timing_headers(timings: Timings, total_s: float, prompt_tokens: int, generated_tokens: int = 0, *,
                   cached_tokens: int | None = None, report_cached: bool = True) -> dict[str, str]:
    """TGI's timing headers, in milliseconds. x-cached-tokens is `cached_tokens` (what the body's usage says)
    or else the timings'; left out when REFORMER_PREFIX_CACHE_REPORT=false (`report_cached`)."""
    headers = {
        "x-queue-time": str(round(timings.queue_s * 1000)),
        "x-inference-time": str(round(timings.inference_s * 1000)),
        "x-total-time": str(round(total_s * 1000)),
        "x-prompt-tokens": str(prompt_tokens),
        "x-cached-tokens": str(timings.cached_tokens if cached_tokens is None else cached_tokens),
        "x-generated-tokens": str(generated_tokens),
    }
    if not report_cached:
        del headers["x-cached-tokens"]
    return headers


def observe(state: ServiceState, route: str, timings: Timings, prompt_tokens: int) -> None:
    m = state.metrics
    m.queue_time.labels(route).observe(timings.queue_s)
    m.inference_time.labels(route).observe(timings.inference_s)
    m.input_tokens.labels(route).observe(prompt_tokens)


def sse(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class EventStreamResponse(StreamingResponse):
    """Server-Sent Events; the event generator is always closed and `on_close` (the work's cancel) always
    called, so a dropped stream cancels its work. Closing alone would not do: a generator closed before its
    first event (the client left before the response started) never runs its body, `finally` included."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})
        self._events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


def disconnected_response() -> Response:
    return Response(status_code=CLIENT_CLOSED)


_ERROR_TEXT = {
    400: "Invalid request: a field's value, a field this server does not take, or input longer than the limit "
         "(OpenAI's error object; `code` names the service's error_type).",
    401: "Missing or wrong API key (when one is configured).",
    404: "The request names a model this server does not serve (error code model_not_found).",
    408: "Request body not received within body_timeout_s (error_type body_timeout).",
    413: "Request body larger than max_payload_bytes.",
    422: "Validation failed (error_type validation), including input longer than the limit or input plus new "
         "tokens beyond the model's positions (the message names the limit).",
    429: "Queue full; retry after Retry-After seconds.",
    500: "Unexpected error (generic message; details in the server log).",
    503: "Model not loaded yet, or the server is draining.",
    504: "Waited in the queue longer than request_timeout_s.",
}

_ERROR_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "`Bearer`.", "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "Seconds to wait before retrying.", "required": True,
                          "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying (while loading or draining).",
                          "schema": {"type": "string"}}},
}

# What can fail where: every route may need the API key and may fail unexpectedly; routes with a body may
# be too large or invalid; only routes that queue for the model can be refused (429) or time out (504).
INFERENCE_CODES = (401, 408, 413, 422, 429, 500, 503, 504)
TOKENIZE_CODES = (401, 408, 413, 422, 500, 503)
READ_CODES = (401, 500, 503)
METRICS_CODES = (401, 500)


def error_responses(model: type[BaseModel], codes: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each error status it can answer, with its body and headers."""
    documented: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {"model": model, "description": _ERROR_TEXT[code]}
        if code in _ERROR_HEADERS:
            entry["headers"] = _ERROR_HEADERS[code]
        documented[code] = entry
    return documented


# Error responses each inference route documents in the OpenAPI schema; /v1 routes answer 400 where the
# native ones answer 422 (service/errors.py status_for).
NATIVE_ERRORS = error_responses(ErrorResponse, INFERENCE_CODES)
OPENAI_INFERENCE_CODES = tuple(sorted({400 if code == 422 else code for code in INFERENCE_CODES} | {404}))
OPENAI_ERRORS = error_responses(OpenAIErrorResponse, OPENAI_INFERENCE_CODES)
# With any 4xx documented, FastAPI does not add its own 422 (HTTPValidationError) that /v1 never answers.
OPENAI_ERRORS["4XX"] = {"model": OpenAIErrorResponse,
                        "description": "Every client error of a /v1 route has OpenAI's error object."}
