"""Structured output's refusals and guarantees: a constraint the engine cannot compile is refused naming the
construct; one built to blow up compilation is refused within the time limit while the server goes on serving;
the same request and seed give the same text alone or batched with others; /info names the engine and the
metrics count requests, compile and mask time, and refusals."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.text.structured import ConstraintSource
from tests.service.helpers import metric_value, running_app, wait_until

PROMPT = "Once upon a time"
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TIMEOUT_S = 0.05


def wide_schema(branches: int) -> dict[str, Any]:
    """anyOf over many objects of 30 required keys each: llguidance's compile time grows with it (about 0.1 s
    per 40 branches on this machine), while its size stays under llguidance's own grammar limit."""
    return {"anyOf": [{"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(30)},
                       "required": [f"k{i}_{j}" for j in range(30)]} for i in range(branches)]}


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_wait_ms=0, max_new_tokens=32, structured_max_bytes=2**20,
                     structured_compile_timeout_s=TIMEOUT_S) as c:
        yield c


def completions(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, **fields})


@pytest.mark.parametrize("fields, construct", [
    ({"guided_json": {"type": "strng"}}, "strng"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "if": {"type": "string"}, "then": {"type": "string"}}}}}, '"if"'),
    ({"guided_json": {"$ref": "#/definitions/missing"}}, "/definitions/missing"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "missing_rule"),
    ({"guided_json": {"$ref": "#"}}, "no text matches it"),  # a document nested without end
    ({"guided_grammar": "start: start"}, "no text matches it"),
])
def test_a_schema_the_engine_cannot_compile_is_refused_naming_the_construct(client: TestClient, fields: dict[str, Any],
                                                                           construct: str) -> None:
    r = completions(client, **fields)
    assert r.status_code == 400, r.text
    assert construct in r.json()["error"]["message"] and r.json()["error"]["param"].startswith(next(iter(fields)))
    tgi = client.post("/generate", json={"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": {
        "type": "strng"}}}})
    assert tgi.status_code == 422 and "strng" in tgi.json()["error"]


def test_a_schema_built_to_blow_up_compilation_is_refused_within_the_limit(client: TestClient) -> None:
    state = client.app.state.service  # type: ignore[attr-defined]
    schema = wide_schema(300)  # about 1 s to compile here: 20 times TIMEOUT_S
    source = ConstraintSource.schema(schema, "guided_json")
    before = metric_value(client.get("/metrics").text, "reformer_structured_refused_total", {"reason": "timeout"})
    began = time.perf_counter()
    r = completions(client, guided_json=schema)
    assert r.status_code == 400 and "longer than the server's limit" in r.json()["error"]["message"], r.text
    # answered while its compile still runs on the grammar threads: the request did not wait for it
    assert not state.grammars.holds(source), f"answered after {time.perf_counter() - began:.3f} s"
    # meanwhile the model worker serves others
    assert completions(client, max_tokens=2).status_code == 200
    wait_until(lambda: state.grammars.holds(source), 30, "the abandoned compile never ended")
    again = time.perf_counter()
    r = completions(client, guided_json=schema)  # the compile took longer than the limit: refused at once now
    assert r.status_code == 400 and "longer than" in r.json()["error"]["message"]
    assert time.perf_counter() - again < 5
    after = metric_value(client.get("/metrics").text, "reformer_structured_refused_total", {"reason": "timeout"})
    assert after == before + 2


def test_a_constraint_over_the_size_limit_or_llguidances_is_refused(artifact: Any) -> None:
    with running_app(artifact, backend="torch", max_new_tokens=8, structured_max_bytes=1000) as small:
        r = small.post("/v1/completions", json={"prompt": PROMPT, "guided_json": wide_schema(2)})
        assert r.status_code == 400 and "the server's limit is 1000" in r.json()["error"]["message"]
        assert metric_value(small.get("/metrics").text, "reformer_structured_refused_total",
                            {"reason": "too_large"}) == 1
    with running_app(artifact, backend="torch", max_new_tokens=8, structured_max_bytes=2**24) as big:
        r = big.post("/v1/completions", json={"prompt": PROMPT, "guided_json": wide_schema(1000)})
        assert r.status_code == 400 and "too large" in r.json()["error"]["message"], r.text


def test_two_structured_fields_at_once_are_refused(client: TestClient) -> None:
    r = completions(client, guided_json=FLAG, guided_regex="a+")
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    r = completions(client, structured_outputs={"regex": "a+", "choice": ["a"]})
    assert r.status_code == 400 and "regex, choice" in r.json()["error"]["message"]
    r = completions(client, response_format={"type": "json_object", "json_schema": {"schema": FLAG}})
    assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"]


def test_ignore_eos_with_structured_output_is_refused(client: TestClient) -> None:
    r = completions(client, guided_choice=["a", "b"], ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


def test_the_same_seed_gives_the_same_text_alone_or_batched(client: TestClient) -> None:
    def ask(seed: int) -> tuple[str, list[float]]:
        r = completions(client, guided_regex="[a-z]{4}-[0-9]{3}", temperature=1, seed=seed, logprobs=1)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]

    alone = {seed: ask(seed) for seed in range(4)}
    stop = threading.Event()

    def unconstrained_load() -> None:
        while not stop.is_set():
            completions(client, max_tokens=8, temperature=1, ignore_eos=True)

    with ThreadPoolExecutor(6) as pool:
        load = [pool.submit(unconstrained_load) for _ in range(2)]
        together = dict(zip(range(4), pool.map(ask, range(4)), strict=True))
        stop.set()
        for f in load:
            f.result()
    assert together == alone


def test_info_names_the_engine_and_metrics_count_the_work(client: TestClient) -> None:
    info = client.get("/info").json()["structured_output"]
    assert info == {"engine": "llguidance", "version": version("llguidance")}
    text = client.get("/metrics").text
    asked = metric_value(text, "reformer_structured_requests_total", {"kind": "choice"})
    steps = metric_value(text, "reformer_structured_mask_seconds_count")
    assert completions(client, guided_choice=["yes", "no"]).status_code == 200
    text = client.get("/metrics").text
    assert metric_value(text, "reformer_structured_requests_total", {"kind": "choice"}) == asked + 1
    assert metric_value(text, "reformer_structured_mask_seconds_count") >= steps + 2  # a token at least per step
    assert metric_value(text, "reformer_structured_compile_seconds_count") >= 1
    assert metric_value(text, "reformer_structured_refused_total", {"reason": "invalid"}) >= 0
