"""Small helpers shared by the service tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from fastapi.testclient import TestClient

from model.decoding import DecodeCache, Decoder
from model.decoding.extend import open_indexes
from service.api.app import create_app
from service.settings import Settings


@contextmanager
def running_app(artifact: Any, **settings: Any) -> Iterator[TestClient]:
    """An in-process app (lifespan run) that has finished warming up."""
    app = create_app(Settings(**settings), artifact)
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(app.state.service)
        yield client


def wait_ready(state: Any, timeout: float = 60.0) -> None:
    wait_until(lambda: state.ready, timeout, "the app never became ready")


def wait_load_error(state: Any, timeout: float = 30.0) -> str:
    """The reason the app's model load failed, once it has."""
    wait_until(lambda: state.load_error is not None, timeout, "the model load never failed")
    return str(state.load_error)


def wait_until(done: Callable[[], bool], timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.02)
    raise AssertionError(failure)


def sse_events(body: str) -> list[Any]:
    """The `data:` payloads of a Server-Sent Events body, JSON-decoded where they are JSON."""
    events = []
    for block in body.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of one series in Prometheus text (0 if absent)."""
    want = labels or {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        series_name, _, label_text = series.partition("{")
        if series_name != name:
            continue
        found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part)
        found = {k: v.strip('"') for k, v in found.items()}
        if all(found.get(k) == v for k, v in want.items()):
            return float(value)
    return 0.0


def observed_slices(slices: Generator[None, None, Any], on_slice: Callable[[], None]) -> Generator[None, None, Any]:
    """A prefill's slices passed through unchanged (their result too), calling `on_slice` after each: how the
    engine tests see where a sliced prefill yields to decode steps."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
        on_slice()
        yield


@torch.no_grad()
def stepped_logprobs(lm: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits one decode step per token returns (L, vocab), row t after token t: what the
    causal prefill scores a prompt with (service/engine/runner.py `extend_slices`)."""
    cache = DecodeCache.for_tokens(lm, len(ids) + 1)
    decoder = Decoder(lm, cache)
    state = cache.allocate(len(ids) + 1)
    open_indexes(decoder, state)
    rows = [decoder.step([t], [state])[0] for t in ids]
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)
