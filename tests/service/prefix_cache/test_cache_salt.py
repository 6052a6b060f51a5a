"""cache_salt and X-Cache-Salt: prompts under different salts never share a kept state, an in-flight prefill
or a cached_tokens report, on every generation route; a bad salt is refused naming it; with
REFORMER_PREFIX_CACHE_REPORT=false no caller is told of a hit. Measured before: any caller learned from
cached_tokens and x-cached-tokens whether another had sent a document."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.engine.prompt_reuse import NO_IDENTITY
from service.prefix_cache.keys import chain_key
from tests.service.helpers import metric_value, running_app, sse_events

DOC = "In the valley the river turned twice before it reached the mill, where the miller's daughter waited. " * 2
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
# the one-piece prefill (its declared prefixes); the causal prefill's salts: test_causal_cache.py
LIMITS: dict[str, Any] = dict(prefill="one-piece", max_new_tokens=8, max_input_tokens=600, prefix_cache_min_tokens=16)

Ask = Callable[[TestClient, str, dict[str, Any], dict[str, str]], tuple[int, int, Any]]


def _generate(client: TestClient, question: str, salt: dict[str, Any], headers: dict[str, str]) -> Any:
    r = client.post("/generate", headers=headers, json={"inputs": DOC + question, "parameters": {
        "max_new_tokens": 3, "details": True, **salt}})
    return r.status_code, r.json()["details"]["cached_tokens"] if r.status_code == 200 else r.json(), r


def _stream(client: TestClient, question: str, salt: dict[str, Any], headers: dict[str, str]) -> Any:
    r = client.post("/generate_stream", headers=headers, json={"inputs": DOC + question, "parameters": {
        "max_new_tokens": 3, "details": True, **salt}})
    if r.status_code != 200:
        return r.status_code, r.json(), r
    return 200, sse_events(r.text)[-1]["details"]["cached_tokens"], r


def _completion(client: TestClient, question: str, salt: dict[str, Any], headers: dict[str, str]) -> Any:
    r = client.post("/v1/completions", headers=headers, json={"prompt": DOC + question, "max_tokens": 3,
                                                              "temperature": 0, **salt})
    if r.status_code != 200:
        return r.status_code, r.json(), r
    return 200, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r


def _chat(client: TestClient, question: str, salt: dict[str, Any], headers: dict[str, str]) -> Any:
    r = client.post("/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": DOC + question}], "max_tokens": 3, "temperature": 0, **salt})
    if r.status_code != 200:
        return r.status_code, r.json(), r
    return 200, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r


ROUTES: dict[str, Ask] = {"generate": _generate, "generate_stream": _stream, "completions": _completion,
                          "chat": _chat}


@pytest.fixture(scope="module")
def chat_artifact(artifact: Any) -> Any:
    return dataclasses.replace(artifact, chat_template=TEMPLATE)


@pytest.fixture
def client(chat_artifact: Any) -> Iterator[TestClient]:
    with running_app(chat_artifact, **LIMITS) as c:
        yield c


@pytest.mark.parametrize("route", ROUTES)
def test_two_salts_never_share_a_hit_or_a_report(client: TestClient, route: str) -> None:
    ask = ROUTES[route]
    q = f" {route}?"
    a, b = {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}
    assert ask(client, q, a, {})[:2] == (200, 0)
    assert ask(client, q, b, {})[:2] == (200, 0)  # tenant b learns nothing of tenant a's document
    assert ask(client, q, {}, {})[:2] == (200, 0)  # nor does a caller without a salt
    assert ask(client, q, {}, {"X-Cache-Salt": "tenant-a"})[:2] == (200, 0)  # a header is not the field
    hit = ask(client, q, a, {})
    assert hit[:2] == (200, len(DOC + q) + (len("[user] \n[assistant] ") if route == "chat" else 0))
    # the gateway's header and the client's field together: a client cannot leave its gateway's tenant
    assert ask(client, q, a, {"X-Cache-Salt": "gw-1"})[:2] == (200, 0)
    assert ask(client, q, a, {"X-Cache-Salt": "gw-2"})[:2] == (200, 0)
    assert ask(client, q, a, {"X-Cache-Salt": "gw-1"})[1] > 0


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("salt", ["", "with space", "x" * 257, 7, "é", "a\nb"])
def test_a_bad_salt_is_refused_naming_the_field(client: TestClient, route: str, salt: Any) -> None:
    status, body, _ = ROUTES[route](client, " ?", {"cache_salt": salt}, {})
    assert 400 <= status < 500 and "cache_salt" in str(body), body


@pytest.mark.parametrize("route", ROUTES)
def test_a_bad_salt_header_is_refused_naming_it(client: TestClient, route: str) -> None:
    status, body, _ = ROUTES[route](client, " ?", {}, {"X-Cache-Salt": "two words"})
    assert 400 <= status < 500 and "x-cache-salt" in str(body).lower(), body


def test_forks_in_flight_are_keyed_by_salt_too() -> None:
    """With the cache off, identical prompts in flight share one prefill by key: never across salts."""
    from types import SimpleNamespace

    from service.engine.prompt_reuse import PromptReuse

    ids = list(range(300))
    reuse = PromptReuse(None, None, None)  # type: ignore[arg-type]  # keys need neither runner nor cache

    def job(salt: str | None) -> Any:
        return SimpleNamespace(prefill_ids=ids, spec=SimpleNamespace(cache_salt=salt))

    keys = [reuse._key(job(salt)) for salt in ("f:a", "f:b", None, "f:a")]
    assert len(set(keys[:3])) == 3 and keys[0] == keys[3]
    assert chain_key(NO_IDENTITY, ids, "f:a") != chain_key(NO_IDENTITY, ids, "f:b")
    assert chain_key(NO_IDENTITY, ids, "f:a") != chain_key(NO_IDENTITY, ids)
    assert chain_key(NO_IDENTITY, ids, "f:a") == chain_key(NO_IDENTITY, list(ids), "f:a")


def test_with_reports_off_a_hit_is_told_to_no_caller(chat_artifact: Any) -> None:
    with running_app(chat_artifact, **LIMITS, prefix_cache_report=False) as c:
        for ask in ROUTES.values():
            ask(c, " again?", {}, {})
            status, cached, r = ask(c, " again?", {}, {})
            assert (status, cached) == (200, 0)
            assert "x-cached-tokens" not in r.headers
        hits = metric_value(c.get("/metrics").text, "reformer_prefix_cache_hits_tokens_total", {"tier": "memory"})
    assert hits > 0  # the cache still served them


def test_the_cached_tokens_header_says_what_usage_says(client: TestClient) -> None:
    """Several prompts in one /v1/completions request: usage sums their cached tokens, and so does the header
    (it once counted the first prompt's only)."""
    prompts = [DOC + " one?", DOC[::-1] + " two?"]
    body = {"prompt": prompts, "max_tokens": 2, "temperature": 0}
    client.post("/v1/completions", json=body)
    r = client.post("/v1/completions", json=body)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == sum(len(p) for p in prompts)
    assert int(r.headers["x-cached-tokens"]) == cached
