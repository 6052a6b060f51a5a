"""`/health`, `/ready`, `/info` and `/metrics` (the tokenizer routes are in service/api/routes/tokenize.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api.protocol import ErrorResponse
from service.api.routes.common import (
    METRICS_CODES,
    READ_CODES,
    State,
    error_responses,
)
from service.errors import Unavailable

router = APIRouter()

_PROBE_ERRORS = error_responses(ErrorResponse, READ_CODES)


@router.get("/health", tags=["probes"], responses=_PROBE_ERRORS)
async def health(state: State) -> dict[str, str]:
    """Liveness: 200 while the process and its model worker are alive (also while loading)."""
    engine = state.engine
    if state.load_error is not None or (engine is not None and not engine.alive):
        raise Unavailable("the model worker is not running")
    return {"status": "ok"}


@router.get("/ready", tags=["probes"], responses=_PROBE_ERRORS)
async def ready(state: State) -> dict[str, str]:
    """Readiness: 200 once the model is loaded and warmed up; 503 before, and while draining."""
    reason = state.unavailable_reason()
    if reason is not None:
        raise Unavailable(reason)
    return {"status": "ready"}


@router.get("/info", tags=["info"], responses=error_responses(ErrorResponse, READ_CODES))
async def info(state: State) -> dict[str, Any]:
    """The model, backend, device, limits, batching settings and version."""
    return state.info()


@router.get("/metrics", tags=["probes"], response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format."},
                       **error_responses(ErrorResponse, METRICS_CODES)})
async def metrics(state: State) -> Response:
    """Prometheus metrics."""
    # Collectors call NVML and the engine's lock: render in a worker thread, never on the event loop.
    return Response(await run_in_threadpool(state.metrics.render), media_type=CONTENT_TYPE_LATEST)
