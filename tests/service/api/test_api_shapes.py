"""Answers in the shapes the clients expect: TGI's `POST /` list and /info fields, OpenAI's model check and
request log, TEI's truncation direction; and what each refuses, by name."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.helpers import running_app


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_wait_ms=0, max_new_tokens=16, max_input_tokens=64) as c:
        yield c


def test_tgi_root_answers_a_one_element_list_or_a_stream(client: TestClient) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True, "seed": 1}}
    r = client.post("/", json=body)
    assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 1
    assert r.json()[0] == client.post("/generate", json=body).json()
    streamed = client.post("/", json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")


def test_info_carries_tgi_top_level_fields(client: TestClient) -> None:
    info = client.get("/info").json()
    assert info["model_id"] and info["model_sha"] == info["model_sha256"]
    assert info["max_input_tokens"] == 64 and info["max_total_tokens"] == info["limits"]["max_total_tokens"]
    assert info["max_best_of"] == info["limits"]["max_best_of"] >= 2
    assert info["max_stop_sequences"] == info["limits"]["max_stop_sequences"]
    assert isinstance(info["version"], str)


def test_openai_model_names_this_servers_model_or_is_not_found(client: TestClient) -> None:
    served = client.get("/v1/models").json()["data"][0]["id"]
    ok = client.post("/v1/completions", json={"model": served, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["model"] == served
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}), ("/v1/embeddings", {"input": "Hi"})):
        r = client.post(path, json={**body, "model": "gpt-4"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"


def test_openai_user_goes_into_the_request_log(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="service.routes.openai"):
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "user": "u-42"}).status_code == 200
        assert client.post("/v1/embeddings", json={"input": "Hi", "user": "u-43"}).status_code == 200
    users = {getattr(record, "end_user", None) for record in caplog.records}
    assert {"u-42", "u-43"} <= users


@pytest.mark.parametrize("body, param", [
    ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "n": 2}, "n"),
    ({"n": 5}, "n"),
    ({"best_of": 5}, "best_of"),
    ({"stream": True, "best_of": 2}, "best_of"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
def test_openai_refuses_what_it_cannot_honour_by_name(client: TestClient, body: dict[str, Any], param: str) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_tei_truncation_direction_keeps_the_chosen_end(client: TestClient) -> None:
    text = "a" * 80 + "b" * 80
    right = client.post("/embed", json={"inputs": text, "truncate": True}).json()[0]
    left = client.post("/embed", json={"inputs": text, "truncate": True, "truncation_direction": "left"}).json()[0]
    assert right == client.post("/embed", json={"inputs": "a" * 64}).json()[0]
    assert left == client.post("/embed", json={"inputs": "b" * 64}).json()[0]
    r = client.post("/embed", json={"inputs": "a", "prompt_name": "query"})
    assert r.status_code == 422 and "prompt_name" in r.json()["error"]
