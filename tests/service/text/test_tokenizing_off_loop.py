"""Every route tokenizes off the event loop: while a request's text is being tokenized (held here inside the
tokenizer until the test lets it go), /health still answers; and no more than `tokenize_threads` texts are
tokenized at once. WAIT_S bounds a hang, it measures nothing (bench/serving/health_during_tokenize.py
measures /health's latency during real large tokenizations)."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.responses import JSONResponse

from service.api.protocol.tokenize import TokenizeResult
from tests.service.helpers import running_app

MARK = "HOLD-HERE"
WAIT_S = 20.0
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


class HeldTokenizer:
    """The artifact's tokenizer, except that encoding a text with MARK waits until `release` is set."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _hold(self, text: str) -> None:
        if MARK not in text:
            return
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.release()
        self.release.wait(WAIT_S)
        with self._lock:
            self.inside -= 1

    def encode(self, text: str) -> list[int]:
        self._hold(text)
        return list(self._inner.encode(text))

    def offsets(self, text: str) -> list[tuple[int, str, int, int]]:
        self._hold(text)
        return list(self._inner.offsets(text))


ROUTES = [
    ("/tokenize", {"inputs": MARK}),
    ("/tokenize", {"prompt": MARK}),
    ("/tokenize", {"messages": [{"role": "user", "content": MARK}]}),
    ("/generate", {"inputs": MARK, "parameters": {"max_new_tokens": 1}}),
    ("/generate_stream", {"inputs": MARK, "parameters": {"max_new_tokens": 1}}),
    ("/v1/completions", {"prompt": MARK, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": MARK}], "max_tokens": 1}),
    ("/embed", {"inputs": MARK}),
    ("/v1/embeddings", {"input": MARK}),
]


def _post_in_background(client: TestClient, path: str, body: dict[str, Any], out: list[int]) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(client.post(path, json=body).status_code), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_health_answers_while_a_route_tokenizes(artifact: Any, path: str, body: dict[str, Any]) -> None:
    held = HeldTokenizer(artifact.tokenizer)
    app_artifact = dataclasses.replace(artifact, tokenizer=held, chat_template=TEMPLATE)
    with running_app(app_artifact, max_new_tokens=4) as client:
        statuses: list[int] = []
        request = _post_in_background(client, path, body, statuses)
        try:
            assert held.entered.acquire(timeout=WAIT_S), "the route never tokenized its text"
            health: list[int] = []
            probe = threading.Thread(target=lambda: health.append(client.get("/health").status_code), daemon=True)
            probe.start()
            probe.join(WAIT_S)
            assert health == [200], "/health did not answer while a text was being tokenized"
        finally:
            held.release.set()
            request.join(WAIT_S)
        assert statuses == [200]


def test_no_more_texts_are_tokenized_at_once_than_tokenize_threads(artifact: Any) -> None:
    held = HeldTokenizer(artifact.tokenizer)
    with running_app(dataclasses.replace(artifact, tokenizer=held), tokenize_threads=2) as client:
        statuses: list[int] = []
        requests = [_post_in_background(client, "/tokenize", {"prompt": MARK}, statuses) for _ in range(4)]
        try:
            for _ in range(2):
                assert held.entered.acquire(timeout=WAIT_S)
            assert not held.entered.acquire(timeout=0.5)  # the other two wait for a thread
            assert held.inside == 2
        finally:
            held.release.set()
            for request in requests:
                request.join(WAIT_S)
        assert statuses == [200] * 4 and held.most_inside == 2


@pytest.mark.parametrize("body", [
    {"prompt": "x" * 10_000, "return_token_strs": True},
    {"prompt": "a \"quoted\" é text </s>"},
    {"prompt": "", "add_special_tokens": False, "return_token_strs": True},
])
def test_tokenize_answers_what_tokenizeresult_renders(artifact: Any, body: dict[str, Any]) -> None:
    """/tokenize renders its answer without building TokenizeResult (see service/api/routes/tokenize.py): the
    bytes are the model's all the same."""
    with running_app(artifact) as client:
        r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    expected = TokenizeResult.model_validate(json.loads(r.content)).model_dump(mode="json")
    assert r.content == JSONResponse(expected).body


def test_a_text_whose_client_left_while_it_waited_for_a_thread_is_never_tokenized(artifact: Any) -> None:
    held = HeldTokenizer(artifact.tokenizer)
    seen: list[str] = []
    encode = held.encode
    held.encode = lambda text: (seen.append(text), encode(text))[1]  # type: ignore[method-assign]
    gone = "GONE-BEFORE-ITS-TURN"

    async def leave_at_once(app: Any) -> list[dict[str, Any]]:
        body = json.dumps({"inputs": gone, "parameters": {"max_new_tokens": 1}}).encode()
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return next(messages, {"type": "http.disconnect"})

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/generate", "raw_path": b"/generate",
                 "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}
        await app(scope, receive, send)
        return sent

    with running_app(dataclasses.replace(artifact, tokenizer=held), tokenize_threads=1) as client:
        statuses: list[int] = []
        first = _post_in_background(client, "/tokenize", {"prompt": MARK}, statuses)  # holds the one thread
        try:
            assert held.entered.acquire(timeout=WAIT_S)
            sent = client.portal.call(leave_at_once, client.app)  # type: ignore[union-attr]
        finally:
            held.release.set()
            first.join(WAIT_S)
        client.post("/tokenize", json={"prompt": "after"})  # the thread has run whatever was left for it
    assert sent[0]["status"] == 499
    assert statuses == [200] and not any(gone in text for text in seen)
