"""A stream whose client leaves after its first token is ready but before the response starts. Under ASGI 2.4
a server's `send` raises OSError for a client that is gone (Starlette then stops before its first `__anext__`),
so the event generator never starts and its `finally` never runs: the response's own `on_close` must cancel
the work (service/api/routes/common.py EventStreamResponse). Under ASGI 2.3 (uvicorn's HTTP) the disconnect
message stops it. Driven through the ASGI app with a client that leaves exactly in that window."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import pytest

from tests.service.helpers import metric_value, running_app

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
NEW_TOKENS = 1000  # far more than a dropped stream reaches
WAIT_S = 30.0


def _scope(path: str, spec: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}


async def _leave_before_the_response_starts(app: Any, path: str, body: dict[str, Any], spec: str
                                            ) -> list[dict[str, Any]]:
    """Call 1 gets the body; later calls (the route's disconnect watchers, and under 2.3 the streaming
    response's own) get the disconnect once the response has started; under 2.4 `send` raises OSError for the
    response's start, as the spec has a server do for a client that is gone."""
    calls = [0]
    sent: list[dict[str, Any]] = []
    started = asyncio.Event()

    async def receive() -> dict[str, Any]:
        calls[0] += 1
        if calls[0] == 1:
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.wait_for(started.wait(), WAIT_S)  # the route's watchers are cancelled before then
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            started.set()
        if spec == "2.4" and message["type"] == "http.response.start" and message["status"] == 200:
            raise OSError("the client is gone")

    try:
        await app(_scope(path, spec), receive, send)
    except Exception as error:  # Starlette turns the OSError into ClientDisconnect
        assert type(error).__name__ == "ClientDisconnect", error
    return sent


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize(("path", "body"), [
    ("/generate_stream", {"inputs": "stream", "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}),
    ("/v1/completions", {"prompt": "stream", "max_tokens": NEW_TOKENS, "stream": True, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": NEW_TOKENS,
                              "stream": True, "ignore_eos": True}),
])
def test_a_stream_left_before_its_response_starts_is_dropped(artifact: Any, path: str, body: dict[str, Any],
                                                              spec: str) -> None:
    artifact = dataclasses.replace(artifact, chat_template=TEMPLATE)
    with running_app(artifact, max_new_tokens=NEW_TOKENS, max_input_tokens=256) as client:
        state = client.app.state.service  # type: ignore[attr-defined]
        sent = client.portal.call(_leave_before_the_response_starts, client.app, path, body, spec)  # type: ignore[union-attr]
        assert sent and sent[0]["status"] == 200
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and state.engine.stats()["running"]:
            time.sleep(0.01)
        text = client.get("/metrics").text
    assert metric_value(text, "reformer_requests_dropped_total", {"stage": "decode"}) == 1
    assert metric_value(text, "reformer_generated_tokens_total") < NEW_TOKENS / 2
