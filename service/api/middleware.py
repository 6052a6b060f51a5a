"""Pure ASGI middlewares, outermost first: request context (id, access log, request metrics), API key,
request body (read whole under a deadline, 408 past it, 413 beyond the payload limit), availability (503
while loading or draining, 429 while the queue is full). A queue place is reserved only once the body has
arrived, so a client that sends slowly holds nothing anyone else needs. Pure ASGI so streaming passes
through."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import BodyTimeout, Overloaded, error_body
from service.observability.logs import request_id_var
from service.observability.metrics import ServiceMetrics

log = logging.getLogger("service.access")

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Routes whose requests wait in the model's queue (and so can be refused with 429 when it is full).
QUEUED_PATHS = frozenset({"/", "/generate", "/generate_stream", "/embed", "/v1/completions", "/v1/chat/completions",
                          "/v1/embeddings"})
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def declared_length(value: str | None) -> int | None:
    """A Content-Length header's value as a number, None where it is not ASCII digits (the body is then
    counted as it arrives). isdigit() alone also holds for superscripts, which int() refuses, and int()
    refuses more than 4300 digits: a length of more than 18 digits is beyond any payload limit anyway."""
    if value is None or not (value.isascii() and value.isdigit()):
        return None
    digits = value.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else 10**18


async def _send_error(scope: Scope, receive: Receive, send: Send, status: int, error_type: str, message: str,
                      headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(error_body(scope["path"], error_type, message, status), status_code=status,
                            headers=headers)
    await response(scope, receive, send)


class RequestContextMiddleware:
    """Request id (from `x-request-id` or new), access log, `requests_total`, `request_duration_seconds`,
    `inflight_requests`, and the count of in-flight API requests that a drain waits for."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, inflight: Callable[[int], None],
                 known_paths: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.inflight = inflight
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        request_id = request_id[:128]
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500
        counted = scope["path"] not in PROBE_PATHS and scope["path"] not in DOC_PATHS

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        # Probes and docs stay out of the request series: a scrape every few seconds would pull the
        # latency quantiles down to milliseconds and make the in-flight gauge read 1 when idle.
        if counted:
            self.metrics.inflight.inc()
            self.inflight(+1)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if counted:
                self.inflight(-1)
                self.metrics.inflight.dec()
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            # Label by route template; paths no route knows share one label (bounded cardinality).
            label = getattr(route, "path", None) or (
                scope["path"] if scope["path"] in self.known_paths else "unmatched"
            )
            if counted:
                self.metrics.requests.labels(label, str(status)).inc()
                self.metrics.duration.labels(label).observe(elapsed)
            log.info(
                "%s %s %d %.1f ms", scope["method"], scope["path"], status, elapsed * 1000,
                extra={"method": scope["method"], "path": scope["path"], "status": status,
                       "duration_ms": round(elapsed * 1000, 3)},
            )
            request_id_var.reset(token)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route except the docs (and the probes unless configured). `keys`
    maps each accepted key to its caller's tenant (service/api_keys.py), which an accepted request carries in
    `request.state.tenant`."""

    def __init__(self, app: ASGIApp, keys: dict[str, str], protect_probes: bool):
        self.app = app
        self.expected = [(f"Bearer {key}".encode(), tenant) for key, tenant in keys.items()]
        self.protect_probes = protect_probes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in DOC_PATHS or (path in PROBE_PATHS and not self.protect_probes):
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"authorization") or "").encode("latin-1")
        tenant = None
        for expected, name in self.expected:  # every key compared in constant time: no timing oracle on a key
            if hmac.compare_digest(given, expected):
                tenant = name
        if tenant is None:
            await _send_error(scope, receive, send, 401, "unauthorized",
                              "missing or wrong API key: send `Authorization: Bearer <key>`",
                              headers={"WWW-Authenticate": "Bearer"})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class PayloadLimitMiddleware:
    """Reads the whole body before anything inner runs: up to `max_bytes` (413 beyond), within `timeout_s`
    of the headers (408 `body_timeout` past it), then replays it; later receives (disconnects) pass
    through, so handlers can still notice a client that went away. It sits outside the availability
    middleware, so a request holds no queue place while its body is still on the way."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = declared_length(_header(scope, b"content-length"))
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, receive, send, declared)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)  # (asyncio.timeout is 3.11+)
        except asyncio.TimeoutError:  # noqa: UP041 - not the builtin TimeoutError before Python 3.11
            await _send_error(scope, receive, send, BodyTimeout.status_code, BodyTimeout.error_type,
                              f"request body not received within body_timeout_s={self.timeout_s:g} s")
            return
        except _TooLarge as too_large:
            await self._too_large(scope, receive, send, too_large.size)
            return
        if body is None:  # the client went away before it finished sending
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        await _send_error(scope, receive, send, 413, "payload_too_large",
                          f"request body of {size}+ bytes exceeds max_payload_bytes={self.max_bytes}")


class _TooLarge(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


class AvailabilityMiddleware:
    """503 on API routes until the model is loaded and warmed up, and once draining has begun; 429 on the
    queued routes while the queue is full, counting requests still being parsed (Engine.reserve). It sits
    inside the body reader: a place is reserved only for a request whose body has arrived, and the excess
    of a burst is refused before its body is parsed, whatever the model worker is doing."""

    def __init__(self, app: ASGIApp, state: Any):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in PROBE_PATHS and path not in DOC_PATHS:
            reason = self.state.unavailable_reason()
            if reason is not None:
                self.state.metrics.rejected.labels("unavailable").inc()
                await _send_error(scope, receive, send, 503, "unavailable", reason, headers={"Retry-After": "5"})
                return
            if path in QUEUED_PATHS and scope["method"] == "POST":
                await self._queued(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _queued(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.state.engine
        reservation = engine.reserve()
        if isinstance(reservation, Overloaded):
            await _send_error(scope, receive, send, reservation.status_code, reservation.error_type,
                              reservation.message, headers=reservation.headers)
            return
        # handed to the route explicitly: request.state.reservation (Starlette's request.state is scope["state"])
        scope.setdefault("state", {})["reservation"] = reservation
        try:
            await self.app(scope, receive, send)
        finally:
            engine.release(reservation)
