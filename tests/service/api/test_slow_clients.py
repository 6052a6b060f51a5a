"""Slow senders over real HTTP: connections that send their headers and a few bytes of body hold no queue
place (normal clients are served, not refused with 429), and each gets 408 body_timeout once the body
deadline passes (in OpenAI's shape on /v1 routes)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("service-slow-clients")

QUEUE = 2
SLOW = 6  # three times the queue
DEADLINE_S = 4.0


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(backend="torch", max_queue_size=QUEUE, body_timeout_s=DEADLINE_S, max_new_tokens=8,
                          max_input_tokens=64)


def slow_sender(url: str, path: str) -> socket.socket:
    """Headers announcing a 200-byte JSON body, then 5 bytes of it, and nothing more."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            "Content-Length: 200\r\n\r\n")
    sock.sendall(head.encode() + b'{"inp')
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return status, json.loads(rest[:length])


def test_slow_senders_hold_no_queue_place_and_get_408_after_the_deadline(server: Any) -> None:
    started = time.monotonic()
    slow = [slow_sender(server.url, "/generate" if i % 2 else "/v1/completions") for i in range(SLOW)]
    try:
        time.sleep(0.5)  # every slow connection is in the middleware, waiting for the rest of its body
        statuses = []
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while time.monotonic() - started < DEADLINE_S - 1.5:
                r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
                statuses.append(r.status_code)
                e = client.post("/embed", json={"inputs": "Hello"})
                statuses.append(e.status_code)
        assert statuses and set(statuses) == {200}, statuses
        for i, sock in enumerate(slow):
            status, body = read_response(sock)
            assert status == 408, body
            if i % 2:
                assert body["error_type"] == "body_timeout" and "body_timeout_s" in body["error"]
            else:
                assert body["error"]["code"] == "body_timeout" and "body_timeout_s" in body["error"]["message"]
        assert time.monotonic() - started >= DEADLINE_S - 0.5  # not before the deadline
    finally:
        for sock in slow:
            sock.close()
    # Their places (none were held) and connections are gone: the queue is whole for normal clients.
    r = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 200


def test_a_body_that_arrives_in_pieces_within_the_deadline_is_served(server: Any) -> None:
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), 8):
            sock.sendall(body[i:i + 8])
            time.sleep(0.1)
        status, answer = read_response(sock)
    assert status == 200 and "generated_text" in answer
