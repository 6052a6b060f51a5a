"""The clients of a chaos run (bench/serving/chaos.py): request templates, each run alone first for its
reference answer, then a storm of clients that each pick a scenario at random (seeded): complete a request and
compare its answer with the reference, leave at a random point, read a stream slowly, or send a bad, huge,
too long or too slow body. Raw HTTP/1.1 on asyncio streams, so a client can leave at any byte."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

LONG_TEXT = "a sliced prefill needs a long prompt; " * 40  # 1520 bytes: two of them are prefilled in slices


@dataclass(frozen=True)
class Template:
    path: str
    body: dict[str, Any]
    shape: str  # how its answer is compared: "json", "completion", "embed", "embeddings", "sse", "sse_completion"


TEMPLATES = {
    "generate": Template("/generate", {"inputs": "chaos one", "parameters": {"max_new_tokens": 24,
                                                                             "ignore_eos": True}}, "json"),
    "generate_best_of": Template("/generate", {"inputs": "chaos two", "parameters": {
        "max_new_tokens": 16, "best_of": 2, "do_sample": True, "seed": 7, "details": True}}, "json"),
    "generate_long_best_of": Template("/generate", {"inputs": LONG_TEXT, "parameters": {
        "max_new_tokens": 8, "best_of": 2, "do_sample": True, "seed": 3}}, "json"),
    "generate_stream": Template("/generate_stream", {"inputs": "chaos stream", "parameters": {
        "max_new_tokens": 48, "ignore_eos": True}}, "sse"),
    "completions_n": Template("/v1/completions", {"prompt": ["chaos a", "chaos b"], "n": 2, "max_tokens": 12,
                                                  "temperature": 0.9, "seed": 11}, "completion"),
    "completions_stream": Template("/v1/completions", {"prompt": "chaos c", "max_tokens": 32, "stream": True,
                                                       "temperature": 0.7, "seed": 5}, "sse_completion"),
    "score": Template("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1, "echo": True, "logprobs": 1,
                                          "temperature": 0}, "completion"),
    "embed": Template("/embed", {"inputs": ["alpha", "beta gamma", LONG_TEXT[:600]]}, "embed"),
    "embeddings": Template("/v1/embeddings", {"input": ["delta", "epsilon"]}, "embeddings"),
}
STREAMS = [name for name, t in TEMPLATES.items() if t.shape.startswith("sse")]
BAD_BODIES = [b"{not json", b'{"inputs": 5}', b'{"inputs": ""}',
              b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}',
              b'{"prompt": [[1, 2], "x"]}', b"[]", b'{"inputs": "x", "unknown_field": 1}', b"\xff\xfe"]
SCENARIOS = ["complete"] * 7 + ["leave"] * 6 + ["slow_read"] * 2 + ["bad"] * 2 + ["huge", "too_long", "slow_body"]


def metric_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of a metric's series in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith(name + " ") or line.startswith(name + "{")):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in (labels or {}).items()):
            total += float(value)
    return total


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def request_bytes(host: str, path: str, body: bytes, method: str = "POST") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader, chunk_delay_s: float = 0.0) -> Response:
    """A whole HTTP/1.1 response (content-length, chunked, or to the connection's end); with `chunk_delay_s`
    read 256 bytes at a time with a pause between (a slow reader)."""
    raw = bytearray()
    while True:
        piece = await reader.read(256 if chunk_delay_s else 65536)
        if not piece:
            break
        raw += piece
        if chunk_delay_s:
            await asyncio.sleep(chunk_delay_s)
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    if headers.get("transfer-encoding") == "chunked":
        body, data = bytearray(), rest
        while data:
            size_line, _, data = data.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            body += data[:size]
            data = data[size + 2:]
        rest = bytes(body)
    return Response(int(status_line.split(" ")[1]), headers, rest)


def sse_payloads(body: bytes) -> list[Any]:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _without_cached_tokens(answer: Any) -> Any:
    """TGI's details less `cached_tokens`: how much of the prompt another request in flight prefilled is a
    report of the moment, like the timing headers, not part of the answer."""
    if isinstance(answer, dict):
        return {k: _without_cached_tokens(v) for k, v in answer.items() if k != "cached_tokens"}
    if isinstance(answer, list):
        return [_without_cached_tokens(v) for v in answer]
    return answer


def answer_of(shape: str, body: bytes) -> Any:
    """What of an answer must equal the reference (no ids, timestamps or timings)."""
    if shape == "json":
        return _without_cached_tokens(json.loads(body))
    if shape == "completion":
        return [(c["text"], c["finish_reason"], c.get("logprobs")) for c in json.loads(body)["choices"]]
    if shape == "embed":
        return json.loads(body)
    if shape == "embeddings":
        return [d["embedding"] for d in json.loads(body)["data"]]
    events = [e for e in sse_payloads(body) if e != "[DONE]"]
    if shape == "sse":
        return [(e["token"]["id"], e.get("generated_text")) for e in events]
    return "".join(c["text"] for e in events for c in e["choices"])


def same(shape: str, a: Any, b: Any) -> bool:
    if shape in ("embed", "embeddings"):
        return len(a) == len(b) and all(len(x) == len(y) and all(math.isclose(p, q, abs_tol=1e-5)
                                                                   for p, q in zip(x, y, strict=True))
                                        for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Chaos:
    def __init__(self, url: str, seed: int, settings: dict[str, Any]) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.rng = random.Random(seed)
        self.settings = settings
        self.references_: dict[str, Any] = {}
        self.statuses: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.mismatches: list[str] = []
        self.lost: list[str] = []
        self.dropped_before: dict[str, float] = {}
        self.dropped_after: dict[str, float] = {}

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)

    async def call(self, path: str, body: bytes, method: str = "POST", chunk_delay_s: float = 0.0) -> Response:
        reader, writer = await self._connect()
        try:
            writer.write(request_bytes(f"{self.host}:{self.port}", path, body, method))
            await writer.drain()
            return await read_response(reader, chunk_delay_s)
        finally:
            writer.close()

    async def _dropped(self) -> dict[str, float]:
        text = (await self.call("/metrics", b"", "GET")).body.decode()
        return {stage: metric_sum(text, "reformer_requests_dropped_total", {"stage": stage})
                for stage in ("queued", "prefill", "decode", "embed")}

    async def references(self) -> None:
        """Each template alone, one after another: the answers the storm's must equal."""
        for name, template in TEMPLATES.items():
            r = await self.call(template.path, json.dumps(template.body).encode())
            if r.status != 200:
                raise RuntimeError(f"the reference {name} answered {r.status}: {r.body[:300]!r}")
            self.references_[name] = answer_of(template.shape, r.body)
        self.dropped_before = await self._dropped()

    def _note(self, scenario: str, path: str, status: int) -> None:
        self.statuses[f"{path} {status}"] += 1
        self.outcomes[f"{scenario} {status}"] += 1

    async def _complete(self, name: str, slow: bool) -> None:
        template = TEMPLATES[name]
        r = await self.call(template.path, json.dumps(template.body).encode(), chunk_delay_s=0.03 if slow else 0.0)
        self._note("slow_read" if slow else "complete", template.path, r.status)
        if r.status == 200 and not same(template.shape, answer_of(template.shape, r.body), self.references_[name]):
            self.mismatches.append(name)

    async def _leave(self, name: str) -> None:
        """Send the request, then leave after a random pause, or (a stream) after a random number of events."""
        template = TEMPLATES[name]
        reader, writer = await self._connect()
        try:
            writer.write(request_bytes(f"{self.host}:{self.port}", template.path, json.dumps(template.body).encode()))
            await writer.drain()
            if template.shape.startswith("sse") and self.rng.random() < 0.5:
                for _ in range(self.rng.randint(1, 8)):
                    if not await reader.read(64):
                        break
            else:
                await asyncio.sleep(self.rng.uniform(0.0, 0.6))
        finally:
            writer.transport.abort()  # gone, without a goodbye
        self.outcomes[f"leave {name}"] += 1

    async def _bad(self, scenario: str) -> None:
        limit = int(self.settings["max_payload_bytes"])
        if scenario == "bad":
            path, body = self.rng.choice(["/generate", "/v1/completions", "/embed"]), self.rng.choice(BAD_BODIES)
        elif scenario == "huge":
            path, body = "/generate", json.dumps({"inputs": "x" * (limit + 1000)}).encode()
        else:  # too long for the model, within the payload limit
            path, body = "/v1/completions", json.dumps({"prompt": "y" * (int(self.settings["max_input_tokens"]) + 500),
                                                        "max_tokens": 1}).encode()
        try:
            r = await self.call(path, body)
        except ConnectionError:  # a huge body may be cut off with its 413 while it is still being sent
            self.outcomes[f"{scenario} connection_closed"] += 1
            return
        self._note(scenario, path, r.status)
        if not 400 <= r.status < 500:
            self.lost.append(f"{scenario} {path} answered {r.status}")

    async def _slow_body(self) -> None:
        """Half a body, then a pause past body_timeout_s: 408."""
        body = json.dumps(TEMPLATES["generate"].body).encode()
        reader, writer = await self._connect()
        try:
            data = request_bytes(f"{self.host}:{self.port}", "/generate", body)
            writer.write(data[: len(data) - len(body) // 2])
            await writer.drain()
            r = await read_response(reader)
        finally:
            writer.close()
        self._note("slow_body", "/generate", r.status)

    async def _client(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            scenario = self.rng.choice(SCENARIOS)
            try:
                if scenario == "complete":
                    await self._complete(self.rng.choice(list(TEMPLATES)), slow=False)
                elif scenario == "slow_read":
                    await self._complete(self.rng.choice(STREAMS), slow=True)
                elif scenario == "leave":
                    await self._leave(self.rng.choice(list(TEMPLATES)))
                elif scenario == "slow_body":
                    await self._slow_body()
                else:
                    await self._bad(scenario)
            except (ConnectionError, ValueError, IndexError) as error:
                self.lost.append(f"{scenario}: {type(error).__name__}: {error}")

    async def storm(self, seconds: float, clients: int) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(self._client(deadline) for _ in range(clients)))
        await asyncio.sleep(0)
        self.dropped_after = await self._dropped()

    def report(self) -> dict[str, Any]:
        fives = sum(n for key, n in self.statuses.items() if key.rsplit(" ", 1)[1].startswith("5"))
        return {"statuses": dict(self.statuses), "outcomes": dict(self.outcomes), "statuses_5xx": fives,
                "mismatches": self.mismatches, "lost": self.lost,
                "answers_compared": sum(n for k, n in self.outcomes.items()
                                        if k.startswith(("complete 200", "slow_read 200"))),
                "dropped": {k: self.dropped_after.get(k, 0.0) - v for k, v in self.dropped_before.items()}}
