"""The load test's HTTP side: one coroutine per endpoint that sends a request and times it, and the two
ways of driving them (closed loop at a fixed concurrency, open loop at a fixed arrival rate)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.documents import Document

# endpoint name (as on the command line) -> the route it drives
ROUTES: dict[str, str] = {"generate": "/generate", "stream": "/generate_stream", "embed": "/embed"}
TRANSPORT_ERROR = 0  # status recorded when no HTTP response came back (refused, reset, client timeout)


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    endpoint: str
    status: int  # HTTP status, or TRANSPORT_ERROR
    started_s: float  # perf_counter at send
    latency_s: float  # send -> last byte (streams: the last event)
    error: str | None = None  # error_type from the body, an SSE error event, or the exception's class
    ttft_s: float | None = None  # streams: send -> first token event
    itl_s: list[float] = field(default_factory=list)  # streams: gaps between consecutive token events
    prompt_tokens: int | None = None  # as reported by the server (header or details)
    cached_tokens: int | None = None  # of prompt_tokens, those the server restored instead of prefilling
    question: int | None = None  # --questions-per-doc: which question about its document (0: the first)
    generated_tokens: int = 0  # tokens the client received (generate: details; stream: token events)
    prompt_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 16

    def parameters(self, doc: Document) -> dict[str, Any]:
        # greedy and with details, so token counts come back with the answer
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": False, "details": True}
        if doc.cache_prefix_chars is not None:
            params["cache_prefix_chars"] = doc.cache_prefix_chars
        return params


def _int_header(response: httpx.Response, name: str) -> int | None:
    value = response.headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _error_type(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return "unparsable"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):  # OpenAI shape
            return str(error.get("type", "unknown"))
        return str(payload.get("error_type", "unknown"))
    return "unknown"


def _prompt_tokens(details: dict[str, Any]) -> int | None:
    for key in ("prompt_tokens", "input_length"):  # ours, TGI's
        if isinstance(details.get(key), int):
            return int(details[key])
    return None


def _cached_tokens(details: dict[str, Any]) -> int | None:
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


async def send_generate(client: httpx.AsyncClient, doc: Document, gen: GenerationSettings) -> RequestRecord:
    started = time.perf_counter()
    record = RequestRecord("generate", TRANSPORT_ERROR, started, 0.0, prompt_bytes=doc.nbytes)
    try:
        response = await client.post("/generate", json={"inputs": doc.text, "parameters": gen.parameters(doc)})
    except httpx.HTTPError as exc:
        record.latency_s = time.perf_counter() - started
        record.error = type(exc).__name__
        return record
    record.latency_s = time.perf_counter() - started
    record.status = response.status_code
    if response.status_code != 200:
        record.error = _error_type(response.content)
        return record
    details = response.json().get("details") or {}
    generated = details.get("generated_tokens", _int_header(response, "x-generated-tokens"))
    record.generated_tokens = int(generated or 0)
    record.prompt_tokens = _int_header(response, "x-prompt-tokens") or _prompt_tokens(details)
    record.cached_tokens = _cached_tokens(details)
    if record.cached_tokens is None:
        record.cached_tokens = _int_header(response, "x-cached-tokens")
    return record


async def send_stream(client: httpx.AsyncClient, doc: Document, gen: GenerationSettings) -> RequestRecord:
    started = time.perf_counter()
    record = RequestRecord("stream", TRANSPORT_ERROR, started, 0.0, prompt_bytes=doc.nbytes)
    body = {"inputs": doc.text, "parameters": gen.parameters(doc)}
    last_token_at: float | None = None
    try:
        async with client.stream("POST", "/generate_stream", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = _error_type(await response.aread())
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # comments (keep-alives), event names, blank separators
                    now = time.perf_counter()
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        record.error = str(event.get("error_type", "stream_error"))
                        break
                    if event.get("token") is not None:
                        record.generated_tokens += 1
                        if last_token_at is None:
                            record.ttft_s = now - started
                        else:
                            record.itl_s.append(now - last_token_at)
                        last_token_at = now
                    if event.get("details"):
                        record.prompt_tokens = _prompt_tokens(event["details"])
                        record.cached_tokens = _cached_tokens(event["details"])
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        record.error = type(exc).__name__
    record.latency_s = time.perf_counter() - started
    return record


async def send_embed(client: httpx.AsyncClient, doc: Document, gen: GenerationSettings) -> RequestRecord:
    started = time.perf_counter()
    record = RequestRecord("embed", TRANSPORT_ERROR, started, 0.0, prompt_bytes=doc.nbytes)
    try:
        response = await client.post("/embed", json={"inputs": doc.text, "normalize": True})
    except httpx.HTTPError as exc:
        record.latency_s = time.perf_counter() - started
        record.error = type(exc).__name__
        return record
    record.latency_s = time.perf_counter() - started
    record.status = response.status_code
    if response.status_code != 200:
        record.error = _error_type(response.content)
        return record
    vectors = response.json()
    if not (isinstance(vectors, list) and len(vectors) == 1 and isinstance(vectors[0], list)):
        record.error = "bad_response"
    record.prompt_tokens = _int_header(response, "x-prompt-tokens")
    return record


Sender = Callable[[httpx.AsyncClient, Document, GenerationSettings], Awaitable[RequestRecord]]
SENDERS: dict[str, Sender] = {
    "generate": send_generate,
    "stream": send_stream,
    "embed": send_embed,
}


@dataclass(frozen=True)
class Bound:
    """When a level stops issuing requests: after `requests` of them, or after `duration_s` seconds."""

    requests: int | None = None
    duration_s: float | None = None

    def more(self, issued: int, started: float) -> bool:
        if self.requests is not None:
            return issued < self.requests
        assert self.duration_s is not None
        return time.perf_counter() - started < self.duration_s


Send = Callable[[Document], Awaitable[RequestRecord]]


async def closed_loop(
    send: Send, docs: list[Document], concurrency: int, bound: Bound, on_done: Callable[[RequestRecord], None]
) -> tuple[list[RequestRecord], float]:
    """`concurrency` workers, each sending its next request as soon as the previous one is answered.
    Returns the records and the wall time from the first send to the last answer."""
    records: list[RequestRecord] = []
    issued = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal issued
        while bound.more(issued, started):
            doc = docs[issued % len(docs)]
            issued += 1  # no await between the check and the increment: no other worker interleaves
            record = await send(doc)
            records.append(record)
            on_done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - started


async def open_loop(
    send: Send, docs: list[Document], rate: float, bound: Bound, on_done: Callable[[RequestRecord], None]
) -> tuple[list[RequestRecord], float]:
    """Requests sent at a fixed rate (one every 1/rate seconds) whether or not earlier ones were answered,
    as a real population of users would; a server that cannot keep up shows it in latency and errors."""
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    started = time.perf_counter()

    async def one(doc: Document) -> None:
        record = await send(doc)
        records.append(record)
        on_done(record)

    issued = 0
    while bound.more(issued, started):
        due = started + issued / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(docs[issued % len(docs)])))
        issued += 1
    await asyncio.gather(*tasks)
    return records, time.perf_counter() - started


def make_client(url: str, api_key: str | None, timeout_s: float, max_connections: int) -> httpx.AsyncClient:
    """A client bound to the one server under test: relative paths only, no redirects followed, and no
    proxy or other settings taken from the environment."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        follow_redirects=False,
        trust_env=False,
    )
