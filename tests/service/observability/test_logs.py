"""Log lines name the request they are about, the model worker thread's too: a batched step's line names
each request of the batch, a single request's line its id, in JSON lines and in plain text."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from service.observability.logs import JsonFormatter, RequestIdFilter, working_on
from tests.service.helpers import running_app


class _FormatOnEmit(logging.Handler):
    """Formats each record where it is emitted (the worker thread), as the service's stream handler does."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def engine_lines() -> Iterator[list[dict[str, Any]]]:
    handler = _FormatOnEmit()
    logger = logging.getLogger("service.engine")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def test_a_failed_decode_step_logs_the_request_ids_of_its_rows(artifact: Any, engine_lines: list[dict[str, Any]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with running_app(artifact, backend="torch", max_new_tokens=8) as client:
        runner = client.app.state.service.engine.runner

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("decode broke")

        monkeypatch.setattr(runner, "decode", broken)
        r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                        headers={"x-request-id": "req-worker-1"})
        assert r.status_code == 500
    failed = [line for line in engine_lines if line["message"].startswith("decode step over")]
    assert failed and failed[0]["request_id"] == "req-worker-1", engine_lines


def test_a_batch_names_every_request_and_one_request_names_itself() -> None:
    record = logging.LogRecord("service.engine", logging.INFO, __file__, 1, "step", (), None)
    formatter, plain = JsonFormatter(), RequestIdFilter()
    with working_on(["a", "b", None, "a"]):
        line = json.loads(formatter.format(record))
        plain.filter(record)
    assert line["request_ids"] == ["a", "b"] and "request_id" not in line and record.request_id == "a,b"
    del record.request_id
    with working_on(["c"]):
        assert json.loads(formatter.format(record))["request_id"] == "c"
    assert "request_id" not in json.loads(formatter.format(record))  # outside: the worker's own line
    named = logging.LogRecord("service.engine", logging.INFO, __file__, 1, "one", (), None)
    named.request_id = "own"
    with working_on(["a", "b"]):
        assert json.loads(formatter.format(named))["request_id"] == "own"  # a line's own id comes first
