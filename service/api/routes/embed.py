"""`POST /embed` (TEI shape)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service.api.protocol import EmbedRequest
from service.api.routes.common import (
    NATIVE_ERRORS,
    ClientDisconnected,
    State,
    disconnected_response,
    observe,
    ready_parts,
    reservation_of,
    timing_headers,
    tokenized,
    until_disconnected,
)

router = APIRouter(tags=["embeddings"])
log = logging.getLogger("service.routes.embed")


@router.post("/embed", response_model=list[list[float]], responses=NATIVE_ERRORS)
async def embed(body: EmbedRequest, request: Request, state: State) -> Response:
    """Embed one text or a list of texts: one pooled vector each."""
    started = time.perf_counter()
    engine, limits, tokenizer = ready_parts(state)
    log.debug("embed inputs %r", body.inputs)
    try:
        spec = await tokenized(request, state, body.to_spec, tokenizer, limits)
        result = await until_disconnected(request, engine.embed(spec, reservation=reservation_of(request)))
    except ClientDisconnected:
        return disconnected_response()
    observe(state, "/embed", result.timings, result.prompt_tokens)
    headers = timing_headers(result.timings, time.perf_counter() - started, result.prompt_tokens)
    return JSONResponse(result.vectors, headers=headers)
