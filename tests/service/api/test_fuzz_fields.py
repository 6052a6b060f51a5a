"""Every parsed field of every request model, fed the values parsers trip on: numerals of thousands of digits
(Python's int() refuses more than 4300), exponents past a float's range, digits of other scripts and
superscripts (`isdigit()` holds for them), JSON nested thousands deep, keys of 100,000 characters. Each field
is reached through the route whose body holds it, the rest of the body valid; the answer must be a documented
4xx or a 200, never a 5xx. The fields come from service/api/protocol/parameters.py, which lists them all (its test
checks that against the request models), so a new field is fuzzed without a change here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api.protocol.parameters import PARAMETERS
from tests.service.helpers import running_app

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
# (route, a valid body, where the model's fields sit in it) for each request model of the parameter table
PLACES: dict[str, tuple[str, dict[str, Any], tuple[str | int, ...]]] = {
    "GenerateRequest": ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, ()),
    "GenerateParameters": ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, ("parameters",)),
    "CompletionRequest": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, ()),
    "StreamOptions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True,
                                          "stream_options": {"include_usage": True}}, ("stream_options",)),
    "EmbedRequest": ("/embed", {"inputs": "Hi"}, ()),
    "EmbeddingsRequest": ("/v1/embeddings", {"input": "Hi"}, ()),
    "ChatCompletionRequest": ("/v1/chat/completions", CHAT, ()),
    "ChatMessage": ("/v1/chat/completions", CHAT, ("messages", 0)),
    "TextPart": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}]}, ("messages", 0, "content", 0)),
    "TokenizeBody": ("/tokenize", {"prompt": "Hi"}, ()),
    "DetokenizeRequest": ("/detokenize", {"tokens": [5]}, ()),
    # structured output's (service/api/protocol/structured.py)
    "ResponseFormat": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "response_format": {
        "type": "json_object"}}, ("response_format",)),
    "JsonSchemaFormat": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
        ("response_format", "json_schema")),
    "StructuredOutputs": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "structured_outputs": {}},
                          ("structured_outputs",)),
    "TGIGrammar": ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 1, "grammar": {
        "type": "regex", "value": "a"}}}, ("parameters", "grammar")),
}
FIELDS = [(model, field) for model, rows in PARAMETERS.items() for field in rows]

DEEP = 5000
PARSEABLE = 900
# Raw JSON values (text, not Python values: json.dumps cannot even write an int of 5,000 digits)
ODD_VALUES: dict[str, str] = {
    "5000 digits": "9" * 5000,
    "-5000 digits": "-" + "9" * 5000,
    "5000 digits, leading zeros": "0" * 4999 + "1",
    "30 digits": "1" + "0" * 30,
    "2**64": str(2**64),
    "exponent past float": "1e400",
    "-exponent past float": "-1e400",
    "tiny exponent": "1e-400",
    "5000 decimals": "0." + "0" * 4999 + "1",
    "-0": "-0",
    "4.0": "4.0",
    "arabic digits": json.dumps("١٢٣"),
    "superscript": json.dumps("²"),
    "math digit": json.dumps("𝟗"),
    "5000-digit string": json.dumps("9" * 5000),
    "deep list": "[" * DEEP + "]" * DEEP,
    "deep object": '{"a":' * DEEP + "1" + "}" * DEEP,
    # deep, yet within what the JSON parser takes: it reaches the validators and whatever walks the value
    "parseable deep list": "[" * PARSEABLE + "]" * PARSEABLE,
    "parseable deep object": '{"a":' * PARSEABLE + '"</s>"' + "}" * PARSEABLE,
    "long key": json.dumps({"k" * 100_000: 1}),
    "5000-digit key": json.dumps({"9" * 5000: 1}),
    "unicode-digit keys": json.dumps({"١": 1, "²": 1, "𝟗": 1}),
    "list of huge ids": "[" + "9" * 5000 + "]",
    "null": "null",
    "empty list": "[]",
    "empty object": "{}",
}


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with running_app(replace(artifact, chat_template=template), backend="torch", max_input_tokens=256,
                     max_new_tokens=4, default_new_tokens=4, max_client_batch_size=4, max_wait_ms=0,
                     log_level="warning") as c:
        yield c


def raw_body(model: str, field: str, value: str) -> tuple[str, bytes]:
    """The route and the body with `field` of `model` set to the raw JSON `value`."""
    route, valid, place = PLACES[model]
    marker = "FUZZED-VALUE-MARKER"
    body = json.loads(json.dumps(valid))
    target: Any = body
    for step in place:
        target = target[step]
    target[field] = marker
    return route, json.dumps(body).replace(json.dumps(marker), value).encode()


def check(client: TestClient, route: str, body: bytes) -> None:
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, body[:200], r.status_code, r.text[:500])
    if r.status_code != 200:
        error = r.json()["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert message, r.text[:300]


@pytest.mark.parametrize("model, field", FIELDS, ids=[f"{m}.{f}" for m, f in FIELDS])
def test_every_field_takes_odd_numerals_nesting_and_keys_without_a_5xx(client: TestClient, model: str,
                                                                      field: str) -> None:
    for value in ODD_VALUES.values():
        check(client, *raw_body(model, field, value))


_UNICODE_DIGITS = st.characters(categories=("Nd", "No"))
_NUMERAL = st.one_of(
    st.text(st.sampled_from("0123456789"), min_size=1, max_size=6000),
    st.builds(lambda d, e: f"{d}e{e}", st.integers(-10**6, 10**6), st.integers(-10**6, 10**6)),
    st.text(_UNICODE_DIGITS, min_size=1, max_size=8).map(json.dumps),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
)
_KEYS = st.one_of(st.text(_UNICODE_DIGITS, max_size=8), st.text(st.sampled_from("0123456789"), max_size=5000),
                  st.text(max_size=20))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(where=st.sampled_from(FIELDS), numeral=_NUMERAL, keys=st.lists(_KEYS, max_size=3),
       depth=st.integers(0, 3000), shape=st.sampled_from(["numeral", "object", "nested"]))
def test_drawn_numerals_keys_and_depths_never_5xx(client: TestClient, where: tuple[str, str], numeral: str,
                                                  keys: list[str], depth: int, shape: str) -> None:
    model, field = where
    if shape == "numeral":
        value = numeral
    elif shape == "object":
        value = "{" + ",".join(f"{json.dumps(k)}:{numeral}" for k in keys) + "}"
    else:
        value = "[" * depth + numeral + "]" * depth
    check(client, *raw_body(model, field, value))
