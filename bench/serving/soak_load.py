"""The timed soak's load (bench/serving/soak.py): the mixed requests of the issue, built from book text read from
the corpus folders `reformer data` writes (corpus/data and corpus/corpus, git-ignored), and one request sent and timed.

The mix, by request number i (each request draws from a generator seeded with i, so a run's sequence of
requests is the same every time): every `long_every`-th request a 32-64 KB prompt (alternately /generate
with 4 new tokens and /embed of that one input); otherwise /generate (256 B - 16 KB prompt, log-uniform,
greedy or sampled), /generate_stream left after 5 events, /generate_stream read to its last event, /embed batches of
2-8 inputs, /v1/completions, and malformed bodies (invalid JSON, wrong types) that must get 400/422.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.serving.soak_report import OK, SERVER_ERROR, TIMEOUT, TRANSPORT, TRUNCATED, UNEXPECTED, Record

SHORT_BYTES = (256, 16_384)
LONG_BYTES = (32_768, 64_000)
EMBED_BYTES = (256, 4_096)
STREAM_LEFT_AFTER = 5
# kind -> weight among the ordinary requests (the long prompts come on top, every long_every-th request)
WEIGHTS = {"generate": 3, "stream_left": 2, "stream_full": 1, "embed": 3, "completions": 2, "malformed": 1}


class Prompts:
    """Slices of the books under the given directories (*.txt), as text."""

    def __init__(self, directories: list[Path]) -> None:
        files = sorted(p for d in directories if d.is_dir() for p in d.glob("*.txt"))
        if not files:
            raise SystemExit(f"no *.txt under {', '.join(map(str, directories))}: pass --data")
        # one long byte string: a slice of up to 64 KB always fits inside it
        self.text = b"\n".join(p.read_bytes() for p in files)
        self.sources = [p.name for p in files]

    def take(self, rng: random.Random, low: int, high: int, spread: bool = False) -> str:
        """A slice of low..high bytes; `spread`: log-uniform, as many 256 B-1 KB prompts as 4-16 KB ones (the
        sizes a heap fragments over), else uniform."""
        size = round(math.exp(rng.uniform(math.log(low), math.log(high)))) if spread else rng.randint(low, high)
        start = rng.randrange(0, max(1, len(self.text) - size))
        # byte-level tokenizer: bytes are tokens; a cut multi-byte character is dropped, never more
        return self.text[start : start + size].decode("utf-8", "ignore")


@dataclass(frozen=True)
class Planned:
    kind: str
    path: str
    body: Any  # a JSON-able body, or bytes sent as they are (malformed)
    allowed: frozenset[int]


def plan(i: int, prompts: Prompts, long_every: int, longest: int) -> Planned:
    """The i-th request of the mix; `longest` caps a prompt in bytes (the server's max_input_tokens less a
    margin for the new tokens)."""
    rng = random.Random(i)
    ok = frozenset({200})
    if long_every and i % long_every == long_every - 1:
        text = prompts.take(rng, min(LONG_BYTES[0], longest), min(LONG_BYTES[1], longest))
        if (i // long_every) % 2 == 0:
            return Planned("long_generate", "/generate", {"inputs": text, "parameters": {"max_new_tokens": 4}}, ok)
        return Planned("long_embed", "/embed", {"inputs": [text]}, ok)
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    text = prompts.take(rng, *SHORT_BYTES, spread=True)
    if kind == "generate":
        sampled = rng.random() < 0.5
        params = {"max_new_tokens": rng.randint(4, 32), "do_sample": sampled, "seed": i}
        return Planned(kind, "/generate", {"inputs": text, "parameters": params}, ok)
    if kind == "stream_left":  # long enough never to end before the client leaves
        params = {"max_new_tokens": 64, "ignore_eos": True}
        return Planned(kind, "/generate_stream", {"inputs": text, "parameters": params}, ok)
    if kind == "stream_full":
        return Planned(kind, "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": 8}}, ok)
    if kind == "embed":
        inputs = [prompts.take(rng, *EMBED_BYTES, spread=True) for _ in range(rng.randint(2, 8))]
        return Planned(kind, "/embed", {"inputs": inputs}, ok)
    if kind == "completions":
        return Planned(kind, "/v1/completions", {"prompt": text, "max_tokens": rng.randint(4, 16)}, ok)
    bad: list[Any] = [b'{"inputs": "unterminated', {"inputs": 7, "parameters": {"max_new_tokens": "many"}},
                      {"inputs": text, "parameters": {"top_p": 3}}]
    return Planned("malformed", "/generate", bad[i % len(bad)], frozenset({400, 422}))


def _status_outcome(status: int, allowed: frozenset[int]) -> str:
    if status in allowed:
        return OK
    return SERVER_ERROR if status >= 500 else UNEXPECTED


async def _stream(client: httpx.AsyncClient, planned: Planned) -> str:
    """A stream read event by event: left after STREAM_LEFT_AFTER events (stream_left), or to its end,
    which must be a final event (generated_text) and no error event."""
    async with client.stream("POST", planned.path, json=planned.body) as r:
        if r.status_code != 200:
            await r.aread()
            return _status_outcome(r.status_code, planned.allowed)
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            events += 1
            event = json.loads(line[5:])
            if "error" in event:
                return SERVER_ERROR if event.get("error_type") == "internal" else UNEXPECTED
            if planned.kind == "stream_left" and events >= STREAM_LEFT_AFTER:
                return OK  # the client goes away: the server must drop the generation
            if event.get("generated_text") is not None:
                return OK
        return TRUNCATED


async def send(client: httpx.AsyncClient, planned: Planned, t0: float) -> Record:
    """Send one request and time it; every way it can end is an outcome (never raises for the request)."""
    began = time.perf_counter()
    try:
        if planned.path == "/generate_stream":
            outcome = await _stream(client, planned)
        elif isinstance(planned.body, bytes):
            r = await client.post(planned.path, content=planned.body, headers={"content-type": "application/json"})
            outcome = _status_outcome(r.status_code, planned.allowed)
        else:
            r = await client.post(planned.path, json=planned.body)
            outcome = _status_outcome(r.status_code, planned.allowed)
    except httpx.TimeoutException:
        outcome = TIMEOUT
    except httpx.TransportError:
        outcome = TRANSPORT
    except json.JSONDecodeError:  # an event that is not JSON: an answer, but not a valid one
        outcome = UNEXPECTED
    ended = time.perf_counter()
    return Record(planned.kind, ended - t0, ended - began, outcome)
