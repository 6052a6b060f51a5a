"""The real server (uvicorn in a subprocess on a loopback port), driven over HTTP: routes, batch invariance
under concurrency, metrics accounting, and dropped work when clients go away."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.service.helpers import metric_value, sse_events

pytestmark = pytest.mark.xdist_group("service-server")

LONG = 2000  # more new tokens than any test waits for (and within the 2048 positions): ended only by a drop


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    # the PyTorch decode path (about a millisecond a token for the tiny model): a LONG generation then outlasts
    # the 1 s read timeouts below; the C step (about 0.14 ms a token) would end it within them
    return server_factory(backend="torch", max_wait_ms=30, max_new_tokens=LONG, max_input_tokens=512,
                          max_batch_size=8, cpu_kernels=False)


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics").text


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def test_every_route_answers_over_http(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        assert c.get("/info").json()["backend"] == "torch"
        assert c.get("/v1/models").status_code == 200
        assert c.get("/docs").status_code == 200
        assert c.post("/tokenize", json={"inputs": "ab"}).status_code == 200
        g = c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
        assert g.status_code == 200 and "x-inference-time" in g.headers
        assert c.post("/embed", json={"inputs": ["a", "bc"]}).status_code == 200
        assert c.post("/v1/embeddings", json={"input": "a"}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        s = c.post("/generate_stream", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3, "ignore_eos": True}})
        assert len(sse_events(s.text)) == 3
        v = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
        assert sse_events(v.text)[-1] == "[DONE]"
        assert "reformer_requests_total" in c.get("/metrics").text


PROMPTS = ["a", "The quick brown fox", "x" * 37, "Lorem ipsum dolor sit amet, " * 4, "é" * 11, "hello world"]


async def _concurrently(url: str, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        responses = await asyncio.gather(*(c.post(path, json=b) for b in bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def test_embeddings_are_batch_invariant_under_concurrency(server: Any) -> None:
    bodies = [{"inputs": p, "normalize": False} for p in PROMPTS] * 2
    alone = [httpx.post(server.url + "/embed", json=b, timeout=30).json()[0] for b in bodies]
    before = scrape(server.url)
    together = [r[0] for r in asyncio.run(_concurrently(server.url, "/embed", bodies))]
    for a, b in zip(alone, together, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
    # The concurrent round really was batched: fewer model calls than requests.
    after = scrape(server.url)
    calls = metric_value(after, "reformer_batch_size_count", {"kind": "embed"}) - metric_value(
        before, "reformer_batch_size_count", {"kind": "embed"})
    assert calls < len(bodies)


def test_generations_are_batch_invariant_under_concurrency(server: Any) -> None:
    bodies = [
        {"inputs": p, "parameters": {"max_new_tokens": 6 + i, "do_sample": i % 2 == 1, "seed": 100 + i,
                                     "temperature": 0.8, "details": True, "ignore_eos": True}}
        for i, p in enumerate(PROMPTS)
    ]
    alone = [httpx.post(server.url + "/generate", json=b, timeout=60).json() for b in bodies]
    together = asyncio.run(_concurrently(server.url, "/generate", bodies))
    for a, b in zip(alone, together, strict=True):
        assert [t["id"] for t in a["details"]["tokens"]] == [t["id"] for t in b["details"]["tokens"]]
        assert a["generated_text"] == b["generated_text"]


def test_metrics_account_for_exactly_the_requests_made(server: Any) -> None:
    n = 5
    before = scrape(server.url)
    prompts = [f"request number {i}" for i in range(n)]
    for p in prompts:
        r = httpx.post(server.url + "/generate", json={"inputs": p, "parameters": {"max_new_tokens": 3,
                                                                                   "ignore_eos": True}})
        assert r.status_code == 200
    after = scrape(server.url)

    def delta(name: str, labels: dict[str, str] | None = None) -> float:
        return metric_value(after, name, labels) - metric_value(before, name, labels)

    route = {"route": "/generate"}
    assert delta("reformer_requests_total", {**route, "status": "200"}) == n
    assert delta("reformer_request_duration_seconds_count", route) == n
    assert delta("reformer_request_queue_seconds_count", route) == n
    assert delta("reformer_request_inference_seconds_count", route) == n
    assert delta("reformer_input_tokens_sum", route) == sum(len(p.encode()) for p in prompts)
    assert delta("reformer_prompt_tokens_total") == sum(len(p.encode()) for p in prompts)
    assert delta("reformer_generated_tokens_total") == 3 * n
    assert delta("reformer_time_to_first_token_seconds_count") == n
    assert delta("reformer_inter_token_latency_seconds_count") == 2 * n
    assert metric_value(after, "reformer_queue_size", {"kind": "generate"}) == 0


def test_gpu_series_only_where_cuda_is(server: Any) -> None:
    import torch

    text = scrape(server.url)
    assert ("reformer_gpu_memory_allocated_bytes" in text) == torch.cuda.is_available()
    assert "process_resident_memory_bytes" in text


def _dropped(url: str) -> float:
    return metric_value(scrape(url), "reformer_requests_dropped_total", {"stage": "decode"})


def _idle(url: str) -> bool:
    text = scrape(url)
    return (metric_value(text, "reformer_running_generations") == 0
            and metric_value(text, "reformer_decode_cache_bytes") == 0)


def test_a_stream_whose_client_leaves_is_dropped_and_its_cache_freed(server: Any) -> None:
    dropped = _dropped(server.url)
    body = {"inputs": "stream forever", "parameters": {"max_new_tokens": LONG, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/generate_stream", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: metric_value(scrape(server.url), "reformer_running_generations") == 1)
    wait_for(lambda: _dropped(server.url) == dropped + 1)
    wait_for(lambda: _idle(server.url))


def test_a_plain_request_whose_client_leaves_is_dropped(server: Any) -> None:
    dropped = _dropped(server.url)
    body = {"inputs": "never read", "parameters": {"max_new_tokens": LONG, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, timeout=httpx.Timeout(30, read=1.0))
    wait_for(lambda: _dropped(server.url) == dropped + 1)
    wait_for(lambda: _idle(server.url))
    text = scrape(server.url)
    assert metric_value(text, "reformer_requests_total", {"route": "/generate", "status": "499"}) >= 1


def test_process_settings_are_the_ones_serve_runs_under() -> None:
    """`apply_process_settings` (what `reformer serve` calls, and bench/prefill/prefill_gap.py with it): the GIL switch
    interval and the CPU runtime's settings."""
    import sys

    import torch

    from service.api.server import SWITCH_INTERVAL_S, apply_process_settings

    before = sys.getswitchinterval()
    try:
        done = apply_process_settings()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert set(done) == {"flush_denormal", "malloc_thresholds"}
    finally:  # the rest of this test process keeps Python's and torch's defaults
        sys.setswitchinterval(before)
        torch.set_flush_denormal(False)
