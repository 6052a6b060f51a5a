"""Access over real HTTP: API key (401, probes setting), CORS, payload limit, and what the log may hold."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.service.helpers import metric_value

pytestmark = pytest.mark.xdist_group("service-access")

KEY = "s3cret-key-for-tests-0123456789"
ORIGIN = "https://app.example"
PROMPT = "a very distinctive prompt 4f1c"


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(backend="torch", api_key=KEY, cors_origins=f"{ORIGIN},https://other.example",
                          max_payload_bytes=5000)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_inference_routes_need_the_key(server: Any, headers: dict[str, str]) -> None:
    r = httpx.post(server.url + "/generate", json={"inputs": "a"}, headers=headers)
    assert r.status_code == 401
    assert r.json()["error_type"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    v = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
    assert v.status_code == 401 and v.json()["error"]["code"] == "unauthorized"
    assert httpx.get(server.url + "/info", headers=headers).status_code == 401


def test_the_right_key_is_let_in(server: Any) -> None:
    r = httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
                   headers=auth())
    assert r.status_code == 200
    assert httpx.post(server.url + "/embed", json={"inputs": "a"}, headers=auth()).status_code == 200


def test_probes_and_docs_are_open_by_default(server: Any) -> None:
    for path in ("/health", "/ready", "/metrics", "/docs", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_probes_can_require_the_key(artifact: Any) -> None:
    from tests.service.helpers import running_app

    with running_app(artifact, api_key=KEY, api_key_on_probes=True) as client:
        for path in ("/health", "/ready", "/metrics"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers=auth()).status_code == 200


def test_cors_allows_only_configured_origins(server: Any) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(server.url + "/generate", headers={"Origin": ORIGIN, **preflight})
    assert ok.headers.get("access-control-allow-origin") == ORIGIN
    denied = httpx.options(server.url + "/generate", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in denied.headers


def test_cors_is_off_without_origins(artifact: Any) -> None:
    from tests.service.helpers import running_app

    with running_app(artifact) as client:
        r = client.get("/health", headers={"Origin": ORIGIN})
        assert "access-control-allow-origin" not in r.headers


def test_payload_limit_gives_413(server: Any) -> None:
    r = httpx.post(server.url + "/embed", json={"inputs": "a" * 6000}, headers=auth())
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_chunked_payload_over_the_limit_gives_413(server: Any) -> None:
    def chunks() -> Any:
        yield b'{"inputs": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    r = httpx.post(server.url + "/embed", content=chunks(), headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 413


def test_refusals_before_routing_are_counted_under_their_route(server: Any) -> None:
    def counts() -> tuple[float, float, float]:
        text = httpx.get(server.url + "/metrics").text
        unmatched = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("reformer_requests_total{") and 'route="unmatched"' in line)
        return (metric_value(text, "reformer_requests_total", {"route": "/generate", "status": "401"}),
                metric_value(text, "reformer_requests_total", {"route": "/generate", "status": "413"}), unmatched)

    before = counts()
    assert httpx.post(server.url + "/generate", json={"inputs": "a"}).status_code == 401
    assert httpx.post(server.url + "/generate", json={"inputs": "a" * 6000}, headers=auth()).status_code == 413
    after = counts()
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 1, 0)


def test_log_never_holds_the_key_nor_prompts_at_info(server: Any) -> None:
    httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1}},
               headers=auth())
    log = server.log()
    assert KEY not in log
    assert PROMPT not in log
    assert '"request_id"' in log  # structured lines carry the request id
