"""Structured logging: one JSON object per line, carrying the request id of the request being handled."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# On the model worker thread, which serves many requests at once: the ids of the requests whose work is
# running (a batched step's rows), so that its log lines name them as the handlers' lines name theirs.
work_ids_var: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("work_ids", default=())


@contextlib.contextmanager
def working_on(request_ids: Iterable[str | None]) -> Iterator[None]:
    """Log lines emitted inside carry these request ids (the worker thread's batched work)."""
    token = work_ids_var.set(tuple(dict.fromkeys(i for i in request_ids if i)))
    try:
        yield
    finally:
        work_ids_var.reset(token)


def record_ids(record: logging.LogRecord) -> tuple[str | None, list[str]]:
    """The request id a line carries (its own `extra`, the handler's, or the one request the worker is on),
    and the ids of a batch the worker is on when it is several requests'."""
    own = getattr(record, "request_id", None) or request_id_var.get()
    if own:
        return own, []
    ids = work_ids_var.get()
    return (ids[0], []) if len(ids) == 1 else (None, list(ids))

# LogRecord attributes that are not user-supplied `extra` fields.
_STANDARD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON: time, level, logger, message, request id, extras, and the trace if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id, batch = record_ids(record)
        if request_id:
            entry["request_id"] = request_id
        if batch:
            entry["request_ids"] = batch
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and key not in ("request_id", "request_ids") and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["trace"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class RequestIdFilter(logging.Filter):
    """Adds the current request id to plain-text records."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id, batch = record_ids(record)
        record.request_id = request_id or ",".join(batch) or "-"
        return True


def configure_logging(level: str = "info", json_lines: bool = True) -> dict[str, Any]:
    """Configure the root logger (and uvicorn's) once; returns a uvicorn `log_config` that defers to it."""
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    # Our own access log carries the request id and timings; uvicorn's would duplicate it.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    return {"version": 1, "disable_existing_loggers": False}
