"""The body-reading middleware on Content-Length values uvicorn would not let through but an ASGI server or a
proxy might: a value that is not a plain number never raises, and an oversized one is refused before reading."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from service.api.middleware import PayloadLimitMiddleware, declared_length

LIMIT = 1000


async def _inner(scope: Any, receive: Any, send: Any) -> None:
    message = await receive()
    body = json.dumps({"read": len(message["body"])}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _call(length: bytes, body: bytes) -> tuple[int, dict[str, Any]]:
    sent: list[Any] = []
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [(b"content-length", length)]}

    async def receive() -> Any:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(PayloadLimitMiddleware(_inner, LIMIT, timeout_s=5)(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.mark.parametrize("length", ["²".encode("latin-1"), "¹²".encode("latin-1"), b"1_0", b" 5", b"-5", b""])
def test_a_content_length_that_is_no_number_is_not_trusted_nor_raises(length: bytes) -> None:
    assert _call(length, b"{}") == (200, {"read": 2})


@pytest.mark.parametrize("length", [b"9" * 5000, b"0" * 5000 + b"1001", b"1001"])
def test_a_content_length_over_the_limit_is_413_whatever_its_digits(length: bytes) -> None:
    status, body = _call(length, b"{}")
    assert status == 413 and body["error_type"] == "payload_too_large", body


def test_declared_length_reads_plain_digits_only() -> None:
    assert declared_length("0042") == 42 and declared_length("²") is None and declared_length(None) is None
    assert declared_length("9" * 5000) == 10**18
