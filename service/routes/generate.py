"""`POST /generate`, `POST /generate_stream` and TGI's `POST /` (TGI shapes)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service.engine import GenerationStream
from service.errors import ServiceError
from service.jobs import FinishEvent, TokenEvent
from service.protocol import (
    GenerateDetails,
    GenerateRequest,
    GenerateResponse,
    StreamDetails,
    StreamError,
    StreamEvent,
    Token,
)
from service.routes.common import (
    NATIVE_ERRORS,
    ClientDisconnected,
    EventStreamResponse,
    State,
    disconnected_response,
    observe,
    ready_parts,
    reservation_of,
    sse,
    timing_headers,
    until_disconnected,
)

router = APIRouter(tags=["generation"])
log = logging.getLogger("service.routes.generate")


async def collect(stream: GenerationStream) -> tuple[list[TokenEvent], FinishEvent]:
    """Every token of a generation, and how it ended."""
    tokens: list[TokenEvent] = []
    while True:
        event = await stream.next_event()
        tokens.append(event)
        if event.finish is not None:
            return tokens, event.finish


def _token(event: TokenEvent) -> Token:
    return Token(id=event.id, text=event.text, logprob=event.logprob, special=event.special)


@router.post("/generate", response_model=GenerateResponse, responses=NATIVE_ERRORS)
async def generate(body: GenerateRequest, request: Request, state: State) -> Response:
    """Generate a continuation of `inputs` (TGI's /generate)."""
    started = time.perf_counter()
    engine, limits, tokenizer = ready_parts(state)
    spec = body.to_spec(tokenizer, limits)
    log.debug("generate prompt %r", body.inputs)
    stream = engine.generate(spec, reservation=reservation_of(request), stream=False)
    try:
        tokens, finish = await until_disconnected(request, collect(stream))
    except ClientDisconnected:
        return disconnected_response()
    observe(state, "/generate", stream.timings, finish.prompt_tokens)
    text = (body.inputs if body.parameters.return_full_text else "") + finish.generated_text
    details = None
    if body.parameters.details:
        details = GenerateDetails(
            finish_reason=finish.finish_reason, generated_tokens=len(finish.generated_ids),
            prompt_tokens=finish.prompt_tokens, seed=finish.seed, tokens=[_token(t) for t in tokens],
        )
    content = GenerateResponse(generated_text=text, details=details).model_dump(mode="json", exclude_none=True)
    headers = timing_headers(stream.timings, time.perf_counter() - started, finish.prompt_tokens,
                             len(finish.generated_ids))
    return JSONResponse(content, headers=headers)


@router.post(
    "/generate_stream",
    # No JSON 200: the body is an event stream (errors before the first event are JSON with their status).
    response_class=Response,
    responses={**NATIVE_ERRORS, 200: {"content": {"text/event-stream": {}},
                                      "description": "One `data: StreamEvent` per token; errors as StreamError."}},
)
async def generate_stream(body: GenerateRequest, request: Request, state: State) -> Response:
    """Generate with Server-Sent Events, one per token; the last carries generated_text and details."""
    engine, limits, tokenizer = ready_parts(state)
    spec = body.to_spec(tokenizer, limits)
    stream = engine.generate(spec, reservation=reservation_of(request))
    try:
        first = await until_disconnected(request, stream.next_event())  # errors before the stream: real statuses
    except ClientDisconnected:
        return disconnected_response()
    prefix = body.inputs if body.parameters.return_full_text else ""
    return EventStreamResponse(_events(state, stream, first, prefix))


async def _events(state: State, stream: GenerationStream, first: TokenEvent, prefix: str) -> AsyncIterator[bytes]:
    event = first
    try:
        while True:
            finish = event.finish
            if finish is None:
                yield sse(StreamEvent(index=event.index, token=_token(event)).model_dump(mode="json"))
                event = await stream.next_event()
                continue
            observe(state, "/generate_stream", stream.timings, finish.prompt_tokens)
            details = StreamDetails(
                finish_reason=finish.finish_reason, generated_tokens=len(finish.generated_ids),
                prompt_tokens=finish.prompt_tokens, input_length=finish.prompt_tokens, seed=finish.seed,
            )
            final = StreamEvent(index=event.index, token=_token(event), generated_text=prefix + finish.generated_text,
                                details=details)
            yield sse(final.model_dump(mode="json"))
            return
    except ServiceError as error:
        yield sse(StreamError(error=error.message, error_type=error.error_type).model_dump(mode="json"))
    except Exception:
        log.exception("generation stream failed")
        yield sse(StreamError(error="internal error; the server log has the details",
                              error_type="internal").model_dump(mode="json"))
    finally:
        stream.cancel()


@router.post(
    "/",
    response_model=GenerateResponse,
    responses={**NATIVE_ERRORS, 200: {"content": {"text/event-stream": {}},
                                      "description": "As /generate, or with `stream: true` as /generate_stream."}},
)
async def tgi_root(body: GenerateRequest, request: Request, state: State) -> Response:
    """TGI's route for clients pointed at the server's URL (huggingface_hub's `InferenceClient(url)`):
    `stream: true` in the body answers as /generate_stream, otherwise as /generate."""
    if body.stream:
        return await generate_stream(body, request, state)
    return await generate(body, request, state)
