"""Schemathesis against the service's own OpenAPI schema, in-process (ASGI), a bounded number of examples per
operation: no 5xx, and every response (status, content type, headers, body) is one the schema documents."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api.app import create_app
from service.settings import Settings
from tests.service.helpers import running_app

# Per operation; with the tiny model and short generations the file runs in well under two minutes.
MAX_EXAMPLES = 50
FUZZ_CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_headers_conformance,
    schemathesis.checks.response_schema_conformance,
    # Whatever the schema forbids must be refused (4xx), not served.
    schemathesis.checks.negative_data_rejection,
]


# The schema as the app publishes it at /openapi.json (it does not depend on settings or the model).
OPENAPI: dict[str, Any] = create_app(Settings()).openapi()  # type: ignore[call-arg]
schema = schemathesis.openapi.from_dict(OPENAPI)


@pytest.fixture(scope="module")
def fuzzed_app(artifact: Any) -> Iterator[Any]:
    """The app under fuzzing, started and warmed up once for the module.

    Schemathesis ends the lifespan of an app it reached after every test item; the app's lifespan runs here
    instead (in the TestClient's loop), and schemathesis gets a view of it that answers only HTTP."""
    # Small limits keep every admitted generation short; requests beyond them must get documented 4xx.
    with running_app(artifact, backend="torch", max_input_tokens=256, max_new_tokens=4, default_new_tokens=4,
                     max_client_batch_size=4, max_wait_ms=0, log_level="warning") as client:
        app = client.app

        async def http_only(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                return  # an app that declines the lifespan scope: schemathesis neither starts nor stops it
            await app(scope, receive, send)

        yield http_only


@pytest.fixture(scope="module")
def fuzzed_client(fuzzed_app: Any) -> TestClient:
    """An HTTP client of the fuzzed app (whose lifespan the fixture above runs: this client does not)."""
    return TestClient(fuzzed_app, raise_server_exceptions=False)


@schema.parametrize()
# derandomize: CI must see the same examples every run (a new failure is found by changing the seed
# locally, not by a red build); the examples still cover every operation of the schema
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_every_response_is_documented_and_no_5xx(case: schemathesis.Case, fuzzed_app: Any) -> None:
    case.call_and_validate(app=fuzzed_app, checks=FUZZ_CHECKS)


# Values around and beyond the limits of the fields the schema cannot bound (the server's max_best_of, the
# vocabulary for logit_bias keys): any int, any key, any JSON value; fuzzed per route below.
_ANY_INT = st.integers(min_value=-(2**63), max_value=2**64)
_BIAS = st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 300).map(str)),
                        st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(), st.text(max_size=3)),
                        max_size=4)
_COMPLETION_FIELDS = st.fixed_dictionaries({}, optional={
    "n": st.one_of(st.integers(-1, 6), _ANY_INT), "best_of": st.one_of(st.integers(-1, 6), _ANY_INT, st.none()),
    "logprobs": st.one_of(st.integers(-1, 22), _ANY_INT, st.none()), "logit_bias": st.one_of(_BIAS, st.none()),
    "echo": st.booleans(), "max_tokens": st.one_of(st.integers(-1, 5), st.none()), "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "temperature": st.floats(-1, 3), "frequency_penalty": st.floats(-3, 3), "presence_penalty": st.floats(-3, 3),
    "prompt": st.one_of(st.just("Hi"), st.lists(st.integers(-2, 300), min_size=1, max_size=4)),
})
_TGI_PARAMETERS = st.fixed_dictionaries({}, optional={
    "best_of": st.one_of(st.integers(-1, 6), _ANY_INT, st.none()),
    "top_n_tokens": st.one_of(st.integers(-1, 22), _ANY_INT, st.none()), "do_sample": st.booleans(),
    "decoder_input_details": st.booleans(), "details": st.booleans(),
    "typical_p": st.one_of(st.floats(-0.5, 1.5), st.none()),
    "frequency_penalty": st.one_of(st.floats(-3, 3), st.none()),
    "temperature": st.one_of(st.floats(-1, 3), st.none()), "watermark": st.booleans(),
})


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(fields=_COMPLETION_FIELDS)
def test_completions_limits_and_logit_bias_never_5xx(fields: dict[str, Any], fuzzed_client: TestClient) -> None:
    r = fuzzed_client.post("/v1/completions", json={"prompt": "Hi", **fields})
    assert r.status_code in (200, 400), (fields, r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["param"], r.text  # the refusal names the field


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(parameters=_TGI_PARAMETERS, route=st.sampled_from(["/generate", "/generate_stream", "/"]))
def test_tgi_limits_never_5xx(parameters: dict[str, Any], route: str, fuzzed_client: TestClient) -> None:
    r = fuzzed_client.post(route, json={"inputs": "Hi", "parameters": parameters})
    assert r.status_code in (200, 422), (parameters, r.status_code, r.text)
    if r.status_code == 422:
        assert r.json()["error_type"] == "validation", r.text


def error_schema_name(responses: dict[str, Any], code: str) -> str:
    return str(responses[code]["content"]["application/json"]["schema"]["$ref"]).rsplit("/", 1)[-1]


def test_schema_documents_every_error_response() -> None:
    """Each inference route documents 401/413/422 (/v1: 400)/429/500/503/504 with the error body its clients
    get; every other route documents at least 401, 500 and (but /metrics) 503; 429 and 503 carry Retry-After."""
    inference = {"/generate", "/generate_stream", "/embed", "/v1/completions", "/v1/embeddings"}
    for path, operations in OPENAPI["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            shape = "OpenAIErrorResponse" if path.startswith("/v1") else "ErrorResponse"
            invalid = "400" if path.startswith("/v1") else "422"  # OpenAI's clients expect 400
            codes = ("401", "413", invalid, "429", "500", "503", "504") if path in inference else ("401", "500")
            for code in codes + (("503",) if path != "/metrics" else ()):
                assert error_schema_name(responses, code) == shape, (method, path, code)
            if "429" in responses:
                assert responses["429"]["headers"]["Retry-After"]["required"] is True, path
            if "503" in responses:
                assert "Retry-After" in responses["503"]["headers"], path
            assert "HTTPValidationError" not in json.dumps(responses), (method, path)


def test_event_stream_routes_document_their_media_types() -> None:
    stream_ok = OPENAPI["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert set(stream_ok) == {"text/event-stream"}
    completions_ok = OPENAPI["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions_ok) == {"application/json", "text/event-stream"}
