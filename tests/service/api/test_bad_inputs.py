"""Bad inputs over real HTTP, one test each: each gets its documented 4xx naming the problem, and the
server goes on serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("service-bad-inputs")

MAX_INPUT = 64
MAX_NEW = 32


@pytest.fixture(scope="module")
def client(server_factory: Any) -> Any:
    server = server_factory(backend="torch", max_input_tokens=MAX_INPUT, max_new_tokens=MAX_NEW,
                            max_payload_bytes=1_000_000, max_client_batch_size=4, max_stop_sequences=2)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
    # After every bad input, the server still serves.
    assert httpx.post(server.url + "/generate", json={"inputs": "ok"}, timeout=30).status_code == 200


def post_raw(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


def assert_error(r: httpx.Response, status: int, error_type: str, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error_type"] == error_type
    for word in words:
        assert word in body["error"], body["error"]


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_or_whitespace_input(client: httpx.Client, text: str) -> None:
    assert_error(client.post("/generate", json={"inputs": text}), 422, "validation", "inputs", "empty")
    assert_error(client.post("/embed", json={"inputs": text}), 422, "validation", "inputs")


def test_nul_bytes(client: httpx.Client) -> None:
    assert_error(client.post("/embed", json={"inputs": "a\u0000b"}), 422, "validation", "inputs", "NUL")


def test_invalid_utf8_body(client: httpx.Client) -> None:
    assert_error(post_raw(client, "/generate", b'{"inputs": "\xff\xfe"}'), 422, "validation", "body")


def test_lone_surrogate(client: httpx.Client) -> None:
    assert_error(post_raw(client, "/embed", b'{"inputs": "a\\ud800b"}'), 422, "validation", "inputs", "surrogate")


def test_malformed_json(client: httpx.Client) -> None:
    assert_error(post_raw(client, "/generate", b'{"inputs": '), 422, "validation", "JSON")


def test_ten_megabyte_body(client: httpx.Client) -> None:
    body = json.dumps({"inputs": "a" * 10_000_000}).encode()
    assert_error(post_raw(client, "/embed", body), 413, "payload_too_large", "max_payload_bytes")


def test_deeply_nested_json(client: httpx.Client) -> None:
    nested = b'{"inputs": "a", "parameters": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = post_raw(client, "/generate", nested)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_wrong_types(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": 5, "parameters": {"max_new_tokens": "many"}})
    assert_error(r, 422, "validation", "inputs", "parameters.max_new_tokens")


@pytest.mark.parametrize("value", [-1, 0])
def test_negative_or_zero_numbers(client: httpx.Client, value: int) -> None:
    r = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": value}})
    assert_error(r, 422, "validation", "parameters.max_new_tokens")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinite_numbers(client: httpx.Client, literal: bytes) -> None:
    r = post_raw(client, "/generate", b'{"inputs": "a", "parameters": {"temperature": ' + literal + b"}}")
    assert_error(r, 422, "validation", "parameters.temperature")


def test_max_new_tokens_over_the_limit(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": MAX_NEW + 1}})
    assert_error(r, 422, "validation", "parameters.max_new_tokens", str(MAX_NEW))


def test_top_p_out_of_range(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "a", "parameters": {"top_p": 1.5}})
    assert_error(r, 422, "validation", "parameters.top_p")


def test_too_many_stop_sequences(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "a", "parameters": {"stop": ["x", "y", "z"]}})
    assert_error(r, 422, "validation", "parameters.stop", "2")


def test_input_over_the_token_limit_without_truncation(client: httpx.Client) -> None:
    long = "z" * (MAX_INPUT + 10)
    assert_error(client.post("/generate", json={"inputs": long}), 422, "validation", "inputs", str(MAX_INPUT))
    assert_error(client.post("/embed", json={"inputs": long}), 422, "validation", "inputs", "truncate")
    r = client.post("/v1/completions", json={"prompt": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "input_too_long"


def test_input_over_the_token_limit_with_truncation(client: httpx.Client) -> None:
    long = "z" * (MAX_INPUT + 10)
    r = client.post("/generate", json={"inputs": long, "parameters": {"truncate": True, "max_new_tokens": 2}})
    assert r.status_code == 200 and r.headers["x-prompt-tokens"] == str(MAX_INPUT)
    r = client.post("/generate", json={"inputs": long, "parameters": {"truncate": 10, "max_new_tokens": 2}})
    assert r.status_code == 200 and r.headers["x-prompt-tokens"] == "10"
    r = client.post("/embed", json={"inputs": long, "truncate": True})
    assert r.status_code == 200 and r.headers["x-prompt-tokens"] == str(MAX_INPUT)


def test_unknown_fields_are_refused_by_name(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "a", "frobnicate": 1, "parameters": {"max_new_tokens": 1}})
    assert_error(r, 422, "validation", "frobnicate", "not permitted")
    r = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1, "min_p": 0.1}})
    assert_error(r, 422, "validation", "parameters.min_p")
    r = client.post("/v1/embeddings", json={"input": "a", "whatever": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "whatever"


def test_huge_list_on_embed(client: httpx.Client) -> None:
    assert_error(client.post("/embed", json={"inputs": ["a"] * 5}), 422, "validation", "inputs", "4")
    assert_error(client.post("/embed", json={"inputs": []}), 422, "validation", "inputs")


def test_openai_routes_answer_errors_in_openai_shape(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "top_p": 7})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "top_p" and error["code"] == "validation" and "top_p" in error["message"]


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert client.get("/nope").status_code == 404
    assert client.get("/generate").status_code == 405
