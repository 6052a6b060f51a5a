"""The bad-input table beyond test_bad_inputs.py: the OpenAI routes, bodies without a Content-Length, type
coercions the schema forbids, sampling values that underflow float32, and messages that name the problem.
Each gets its documented 4xx (or is served, where the value is valid), and the app goes on serving."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.helpers import running_app

MAX_INPUT = 64
MAX_NEW = 8
MAX_PAYLOAD = 1_000_000
JSON_HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_input_tokens=MAX_INPUT, max_new_tokens=MAX_NEW,
                     max_payload_bytes=MAX_PAYLOAD, max_client_batch_size=4, max_stop_sequences=2,
                     log_level="warning") as c:
        yield c
        # After every bad input, the app still serves.
        assert c.post("/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 1}}).status_code == 200


def native_error(r: Any, status: int, error_type: str, *words: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error_type"] == error_type, body
    for word in words:
        assert word in body["error"], body["error"]
    return str(body["error"])


def openai_error(r: Any, status: int, code: str, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def test_deeply_nested_json_is_named(client: TestClient) -> None:
    nested = b'{"inputs": "a", "parameters": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    native_error(client.post("/generate", content=nested, headers=JSON_HEADERS), 422, "validation", "nested too deeply")


def test_invalid_utf8_is_named(client: TestClient) -> None:
    r = client.post("/embed", content=b'{"inputs": "ab\xff\xfe"}', headers=JSON_HEADERS)
    native_error(r, 422, "validation", "UTF-8", "byte 14")


def test_raw_nul_byte_in_the_body(client: TestClient) -> None:
    r = client.post("/generate", content=b'{"inputs": "a\x00b"}', headers=JSON_HEADERS)
    native_error(r, 422, "validation", "not valid JSON", "control character")


def test_nul_character_on_openai_routes(client: TestClient) -> None:
    openai_error(client.post("/v1/completions", json={"prompt": "a\u0000b"}), 400, "validation", "prompt", "NUL")
    openai_error(client.post("/v1/embeddings", json={"input": ["a", "b\u0000"]}), 400, "validation", "input.1", "NUL")


def test_lone_surrogate_message_names_the_client_field_only(client: TestClient) -> None:
    r = client.post("/generate", content=b'{"inputs": "a\\udc00"}', headers=JSON_HEADERS)
    message = native_error(r, 422, "validation", "inputs: ", "lone surrogate")
    assert "function-after" not in message and "valid list" not in message
    r = client.post("/v1/completions", content=b'{"prompt": ["ok", "\\ud800"]}', headers=JSON_HEADERS)
    openai_error(r, 400, "validation", "prompt.1", "surrogate")


@pytest.mark.parametrize(("parameters", "field"), [
    ({"temperature": True}, "parameters.temperature"),
    ({"max_new_tokens": "5"}, "parameters.max_new_tokens"),
    ({"do_sample": "yes"}, "parameters.do_sample"),
    ({"stop": "x"}, "parameters.stop"),
    ({"seed": 1.5}, "parameters.seed"),
])
def test_values_of_the_wrong_json_type_are_refused_not_coerced(client: TestClient, parameters: dict[str, Any],
                                                               field: str) -> None:
    r = client.post("/generate", json={"inputs": "a", "parameters": parameters})
    native_error(r, 422, "validation", field)


def test_wrong_types_on_openai_routes(client: TestClient) -> None:
    openai_error(client.post("/v1/completions", json={"prompt": "a", "max_tokens": "2"}), 400, "validation",
                 "max_tokens")
    openai_error(client.post("/v1/embeddings", json={"input": [1, 2]}), 400, "validation", "input.0")


@pytest.mark.parametrize(("parameters", "field"), [
    ({"temperature": -1.5}, "parameters.temperature"),
    ({"top_k": -2}, "parameters.top_k"),
    ({"top_p": -0.1}, "parameters.top_p"),
    ({"seed": -3}, "parameters.seed"),
    ({"repetition_penalty": -1.0}, "parameters.repetition_penalty"),
    ({"truncate": -4}, "parameters.truncate"),
])
def test_negative_numbers(client: TestClient, parameters: dict[str, Any], field: str) -> None:
    native_error(client.post("/generate", json={"inputs": "a", "parameters": parameters}), 422, "validation", field)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinite_numbers_on_openai_routes(client: TestClient, literal: bytes) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "a", "top_p": ' + literal + b"}", headers=JSON_HEADERS)
    openai_error(r, 400, "validation", "top_p")


@pytest.mark.parametrize("parameters", [
    {"temperature": 1e-300, "do_sample": True},
    {"top_p": 5e-324, "do_sample": True},
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e-300, "do_sample": True, "temperature": 100.0},
])
def test_valid_values_that_underflow_float32_are_served(client: TestClient, parameters: dict[str, Any]) -> None:
    """Positive values the schema allows but float32 sampling rounds to 0 (found by fuzzing: 500s, NaN)."""
    body = {"inputs": "ab", "parameters": {**parameters, "max_new_tokens": 3, "details": True, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert all(math.isfinite(t["logprob"]) for t in r.json()["details"]["tokens"])
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "logprobs": 1, "temperature": 1e-300})
    assert r.status_code == 200 and all(math.isfinite(x) for x in r.json()["choices"][0]["logprobs"]["token_logprobs"])


def test_ten_megabytes_without_a_content_length(client: TestClient) -> None:
    """A chunked body is counted as it arrives: refused once past the limit, not read to the end."""
    def chunks() -> Iterator[bytes]:
        yield b'{"inputs": "'
        for _ in range(100):
            yield b"a" * 100_000
        yield b'"}'

    r = client.post("/embed", content=chunks(), headers=JSON_HEADERS)
    native_error(r, 413, "payload_too_large", f"max_payload_bytes={MAX_PAYLOAD}")
    r = client.post("/v1/embeddings", content=chunks(), headers=JSON_HEADERS)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_a_huge_list_under_the_payload_limit(client: TestClient) -> None:
    body = json.dumps({"inputs": ["a"] * 100_000}).encode()
    assert len(body) < MAX_PAYLOAD
    native_error(client.post("/embed", content=body, headers=JSON_HEADERS), 422, "validation",
                 "100000 items", "at most 4")
    openai_error(client.post("/v1/embeddings", json={"input": ["a"] * 100_000}), 400, "validation", "input",
                 "100000 items")
    openai_error(client.post("/v1/completions", json={"prompt": ["a"] * 5}), 400, "validation", "prompt", "at most 4")


def test_empty_and_whitespace_inputs_on_openai_routes(client: TestClient) -> None:
    openai_error(client.post("/v1/completions", json={"prompt": " \n"}), 400, "validation", "prompt", "empty")
    openai_error(client.post("/v1/embeddings", json={"input": ""}), 400, "validation", "input", "empty")
    openai_error(client.post("/v1/embeddings", json={"input": []}), 400, "validation", "input", "empty list")


def test_openai_limits(client: TestClient) -> None:
    openai_error(client.post("/v1/completions", json={"prompt": "a", "max_tokens": MAX_NEW + 1}), 400, "validation",
                 "max_tokens", str(MAX_NEW))
    openai_error(client.post("/v1/completions", json={"prompt": "a", "stop": ["x", "y", "z"]}), 400, "validation",
                 "stop", "at most 2")
    openai_error(client.post("/v1/completions", json={"prompt": "a", "top_p": 1.01}), 400, "validation", "top_p")


def test_input_over_the_token_limit_on_openai_routes(client: TestClient) -> None:
    long = "z" * (MAX_INPUT + 5)
    openai_error(client.post("/v1/completions", json={"prompt": long}), 400, "input_too_long", "prompt",
                 str(MAX_INPUT), "truncate_prompt_tokens")
    openai_error(client.post("/v1/embeddings", json={"input": long}), 400, "input_too_long", "input", str(MAX_INPUT))
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    openai_error(client.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": MAX_INPUT + 1}), 400,
                 "validation", "truncate_prompt_tokens", str(MAX_INPUT))
    r = client.post("/generate", json={"inputs": long, "parameters": {"truncate": MAX_INPUT + 1}})
    native_error(r, 422, "validation", "parameters.truncate", str(MAX_INPUT))


def test_unknown_fields_are_refused_by_name_on_every_route(client: TestClient) -> None:
    native_error(client.post("/embed", json={"inputs": "a", "pooler": "cls"}), 422, "validation", "pooler")
    native_error(client.post("/generate", json={"inputs": "a", "parameters": {"beam": 2}}), 422, "validation",
                 "parameters.beam")
    openai_error(client.post("/v1/completions", json={"prompt": "a", "min_p": 0.1}), 400, "validation", "min_p")
    # declared fields at values that ask for nothing are accepted as they are
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "best_of": 1, "suffix": None})
    assert r.status_code == 200
