"""Overload: a full queue refuses at once, before the body is read or parsed, with 429 and Retry-After; a
request still being parsed already holds its place in the queue, so a burst cannot overfill it; places held
by requests that were refused, invalid or answered are given back. (Latency is measured in
bench/serving/overload.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig, Reservation
from service.errors import Overloaded
from service.jobs import GenerationSpec
from service.observability.metrics import ServiceMetrics
from tests.service.helpers import metric_value, running_app

QUEUE = 3
SPEC = GenerationSpec(prompt_ids=[5, 6], sampling=SamplingParams(), max_new_tokens=1)


def idle_engine(artifact: Any, queue: int = QUEUE) -> Engine:
    """An engine whose worker is not started: admitted jobs stay queued."""
    return Engine(artifact.model, artifact.tokenizer, backend=None,  # type: ignore[arg-type]
                  device=None, config=EngineConfig(max_queue_size=queue, warmup=False),  # type: ignore[arg-type]
                  metrics=ServiceMetrics())


def test_reservations_count_against_the_queue_and_turn_into_queue_entries(artifact: Any) -> None:
    engine = idle_engine(artifact)

    async def scenario() -> None:
        first = engine.reserve()
        assert isinstance(first, Reservation)
        engine.generate(SPEC, reservation=first)  # admitted: the reservation becomes the job's entry
        assert not first.held and engine.stats()["queued"]["generate"] == 1
        engine.release(first)  # the middleware's release after admission changes nothing
        held = [engine.reserve() for _ in range(QUEUE - 1)]
        assert all(isinstance(r, Reservation) for r in held)
        invalid = held[0]
        assert isinstance(invalid, Reservation)
        refused = engine.reserve()
        assert isinstance(refused, Overloaded) and refused.headers["Retry-After"] == "1"
        with pytest.raises(Overloaded):  # a request without a reservation finds the places taken too
            engine.generate(SPEC)
        engine.release(invalid)  # e.g. that request turned out invalid
        engine.release(invalid)  # releasing twice gives back one place only
        assert isinstance(engine.reserve(), Reservation)
        assert isinstance(engine.reserve(), Overloaded)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def app_client(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_queue_size=QUEUE, max_new_tokens=4, max_payload_bytes=10_000,
                     log_level="warning") as client:
        yield client


def engine_of(client: TestClient) -> Engine:
    engine = client.app.state.service.engine  # type: ignore[attr-defined]
    assert isinstance(engine, Engine)
    return engine


def test_a_full_queue_refuses_before_parsing_the_body(app_client: TestClient) -> None:
    engine = engine_of(app_client)
    held = [engine.reserve() for _ in range(QUEUE)]  # the places a burst's first requests would hold
    try:
        text = app_client.get("/metrics").text
        rejected_before = metric_value(text, "reformer_requests_rejected_total", {"reason": "queue_full"})
        generate_429_before = metric_value(text, "reformer_requests_total", {"route": "/generate", "status": "429"})
        # Not parsed: invalid JSON gets the 429, not 422. The body is read first (no place is held while it
        # is on the way), so an oversized one is refused with 413 while it is read, before any place is asked.
        r = app_client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error_type"] == "overloaded" and "max_queue_size=3" in r.json()["error"]
        r = app_client.post("/generate", content=b"x" * 20_000, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large", r.text
        r = app_client.post("/v1/embeddings", json={"input": "a"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        # Routes that do not queue for the model still answer.
        assert app_client.post("/tokenize", json={"inputs": "a"}).status_code == 200
        assert app_client.get("/health").status_code == 200
        text = app_client.get("/metrics").text
        rejected = metric_value(text, "reformer_requests_rejected_total", {"reason": "queue_full"})
        assert rejected - rejected_before == 2
        # Refused before routing, yet counted under their route (not "unmatched").
        by_route = {"route": "/generate", "status": "429"}
        assert metric_value(text, "reformer_requests_total", by_route) - generate_429_before == 1
        assert metric_value(text, "reformer_requests_total", {"route": "/v1/embeddings", "status": "429"}) >= 1
    finally:
        for reservation in held:
            assert isinstance(reservation, Reservation)
            engine.release(reservation)
    assert app_client.post("/embed", json={"inputs": "a"}).status_code == 200


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 2}}, 200),
    ("/generate_stream", {"inputs": "a", "parameters": {"max_new_tokens": 2}}, 200),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}, 200),
    ("/embed", {"inputs": ""}, 422),
    ("/embed", {"inputs": "a" * 5000}, 422),
])
def test_every_request_gives_its_place_back(app_client: TestClient, path: str, body: dict[str, Any],
                                            status: int) -> None:
    engine = engine_of(app_client)
    assert app_client.post(path, json=body).status_code == status
    assert engine._reserved == 0 and sum(engine.stats()["queued"].values()) == 0


def test_an_idle_server_admits_a_request_of_more_sequences_than_the_queue_has_places(app_client: TestClient) -> None:
    """17 prompts with n=4 (68 sequences) within every per-request limit: one request, one place in a queue of
    QUEUE; never a 429 that no retry could clear."""
    body = {"prompt": [f"prompt {i}" for i in range(17)], "n": 4, "max_tokens": 2, "temperature": 1.0, "seed": 1}
    for _ in range(2):
        r = app_client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 68
