"""`POST /generate`, `POST /generate_stream` and TGI's `POST /` (TGI shapes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service.api.protocol import (
    GenerateDetails,
    GenerateRequest,
    GenerateResponse,
    StreamDetails,
    StreamError,
    StreamEvent,
    Token,
)
from service.api.protocol.cache_salt import request_salt, salted, tenant_salt
from service.api.protocol.logprobs import tgi_prefill, tgi_token, tgi_top_tokens
from service.api.protocol.native import BestOfSequence
from service.api.routes.common import (
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
    tokenized,
    until_disconnected,
)
from service.api.routes.structured import compile_constraint
from service.engine.core import Engine, GenerationStream
from service.errors import ServiceError, ValidationFailed, native_type
from service.jobs import FinishEvent, GenerationSpec, TokenEvent

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


async def collect_all(streams: list[GenerationStream]) -> list[tuple[list[TokenEvent], FinishEvent]]:
    return list(await asyncio.gather(*(collect(s) for s in streams)))


def start_all(engine: Engine, specs: list[GenerationSpec], request: Request, stream: bool,
              salt: str | None = None) -> list[GenerationStream]:
    """Queue every spec (one request's sequences) under the request's cache salt (`salt`: the body's field, and
    the X-Cache-Salt header); if one is refused, the ones queued already are dropped."""
    streams: list[GenerationStream] = []
    specs = salted(specs, request_salt(request.headers, salt, tenant_salt(request)))
    try:
        for spec in specs:
            streams.append(engine.generate(spec, reservation=reservation_of(request), stream=stream))
    except ServiceError:
        for s in streams:
            s.cancel()
        raise
    return streams


def summed_logprob(tokens: list[TokenEvent]) -> float:
    """What best_of ranks sequences by (TGI and vLLM): the generated tokens' summed logprob."""
    return sum(t.logprob for t in tokens)


def _details(tokenizer: Any, prompt_ids: list[int], tokens: list[TokenEvent], finish: FinishEvent,
             top_n: int) -> dict[str, Any]:
    """The parts TGI's details and best_of_sequences share."""
    return dict(
        finish_reason=finish.finish_reason, generated_tokens=len(finish.generated_ids), seed=finish.seed,
        prefill=tgi_prefill(tokenizer, prompt_ids, tokens[0].prompt_logprobs), tokens=[tgi_token(t) for t in tokens],
        top_tokens=[tgi_top_tokens(tokenizer, t.top) for t in tokens] if top_n else None,
    )


def _drop_unasked(content: dict[str, Any]) -> None:
    """TGI leaves out details, top_tokens and best_of_sequences unless asked (a prefill logprob stays null)."""
    if content["details"] is None:
        del content["details"]
        return
    for part in (content["details"], *(content["details"].get("best_of_sequences") or ())):
        for key in ("top_tokens", "best_of_sequences"):
            if key in part and part[key] is None:
                del part[key]


def _refuse_contradicting_stream(body: GenerateRequest, streaming: bool) -> None:
    if "stream" in body.model_fields_set and body.stream != streaming:
        route = "/generate_stream or POST /" if body.stream else "/generate or POST /"
        raise ValidationFailed(f"stream: {str(body.stream).lower()} is answered by {route}", param="stream")


@router.post("/generate", response_model=GenerateResponse, responses=NATIVE_ERRORS)
async def generate(body: GenerateRequest, request: Request, state: State) -> Response:
    """Generate a continuation of `inputs` (TGI's /generate)."""
    _refuse_contradicting_stream(body, streaming=False)
    content, headers = await _generate(body, request, state, "/generate")
    if content is None:
        return disconnected_response()
    return JSONResponse(content, headers=headers)


async def _generate(body: GenerateRequest, request: Request, state: State, route: str
                    ) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """/generate's answer and headers (None: the client went away); with best_of, the best of its sequences."""
    started = time.perf_counter()
    engine, limits, tokenizer = ready_parts(state)
    await compile_constraint(state, body.parameters, ignore_eos=body.parameters.ignore_eos)
    try:
        specs = await tokenized(request, state, body.to_specs, tokenizer, limits)
    except ClientDisconnected:
        return None, {}
    log.debug("generate prompt %r", body.inputs)
    streams = start_all(engine, specs, request, stream=False, salt=body.parameters.cache_salt)
    try:
        results = await until_disconnected(request, collect_all(streams))
    except ClientDisconnected:
        return None, {}
    finally:
        for s in streams:
            s.cancel()
    for s, (_, finish) in zip(streams, results, strict=True):
        observe(state, route, s.timings, finish.prompt_tokens)
    best = max(range(len(results)), key=lambda i: summed_logprob(results[i][0]))
    tokens, finish = results[best]
    p = body.parameters
    text = (body.inputs if p.return_full_text else "") + finish.generated_text
    details = None
    if p.details:
        prompt_ids = specs[best].prompt_ids
        top_n = p.top_n_tokens or 0
        others = [BestOfSequence(generated_text=(body.inputs if p.return_full_text else "") + f.generated_text,
                                 **_details(tokenizer, prompt_ids, t, f, top_n))
                  for i, (t, f) in enumerate(results) if i != best]
        details = GenerateDetails(prompt_tokens=finish.prompt_tokens, cached_tokens=finish.cached_tokens,
                                  **_details(tokenizer, prompt_ids, tokens, finish,
                                                                                  top_n),
                                  best_of_sequences=others if len(results) > 1 else None)
    content = GenerateResponse(generated_text=text, details=details).model_dump(mode="json")
    _drop_unasked(content)
    generated = sum(len(f.generated_ids) for _, f in results)
    headers = timing_headers(streams[best].timings, time.perf_counter() - started, finish.prompt_tokens, generated,
                             report_cached=state.settings.prefix_cache_report)
    return content, headers


@router.post(
    "/generate_stream",
    # No JSON 200: the body is an event stream (errors before the first event are JSON with their status).
    response_class=Response,
    responses={**NATIVE_ERRORS, 200: {"content": {"text/event-stream": {}},
                                      "description": "One `data: StreamEvent` per token; errors as StreamError."}},
)
async def generate_stream(body: GenerateRequest, request: Request, state: State) -> Response:
    """Generate with Server-Sent Events, one per token; the last carries generated_text and details."""
    _refuse_contradicting_stream(body, streaming=True)
    return await _generate_stream(body, request, state)


async def _generate_stream(body: GenerateRequest, request: Request, state: State) -> Response:
    body.check_streamable()
    engine, limits, tokenizer = ready_parts(state)
    await compile_constraint(state, body.parameters, ignore_eos=body.parameters.ignore_eos)
    try:
        spec = await tokenized(request, state, body.to_spec, tokenizer, limits)
    except ClientDisconnected:
        return disconnected_response()
    (spec,) = salted([spec], request_salt(request.headers, body.parameters.cache_salt, tenant_salt(request)))
    stream = engine.generate(spec, reservation=reservation_of(request))
    try:
        first = await until_disconnected(request, stream.next_event())  # errors before the stream: real statuses
    except ClientDisconnected:
        return disconnected_response()
    prefix = body.inputs if body.parameters.return_full_text else ""
    top_n = body.parameters.top_n_tokens or 0
    return EventStreamResponse(_events(state, stream, first, prefix, tokenizer if top_n else None),
                               on_close=stream.cancel)


def _unasked(top: list[Token] | None) -> set[str]:
    """TGI leaves top_tokens out of an event unless top_n_tokens asked for them."""
    return {"top_tokens"} if top is None else set()


async def _events(state: State, stream: GenerationStream, first: TokenEvent, prefix: str,
                  tokenizer: Any) -> AsyncIterator[bytes]:
    """The stream's events; `tokenizer` given: each carries its token's top_tokens."""
    event = first
    try:
        while True:
            finish = event.finish
            top = tgi_top_tokens(tokenizer, event.top) if tokenizer is not None else None
            if finish is None:
                yield sse(StreamEvent(index=event.index, token=tgi_token(event), top_tokens=top).model_dump(
                    mode="json", exclude=_unasked(top)))
                event = await stream.next_event()
                continue
            observe(state, "/generate_stream", stream.timings, finish.prompt_tokens)
            details = StreamDetails(
                finish_reason=finish.finish_reason, generated_tokens=len(finish.generated_ids),
                prompt_tokens=finish.prompt_tokens, cached_tokens=finish.cached_tokens,
                input_length=finish.prompt_tokens, seed=finish.seed,
            )
            final = StreamEvent(index=event.index, token=tgi_token(event), top_tokens=top,
                                generated_text=prefix + finish.generated_text, details=details)
            yield sse(final.model_dump(mode="json", exclude=_unasked(top)))
            return
    except ServiceError as error:
        yield sse(StreamError(error=error.message, error_type=native_type(error.error_type)).model_dump(mode="json"))
    except Exception:
        log.exception("generation stream failed")
        yield sse(StreamError(error="internal error; the server log has the details",
                              error_type="internal").model_dump(mode="json"))
    finally:
        stream.cancel()


@router.post(
    "/",
    response_model=list[GenerateResponse],
    responses={**NATIVE_ERRORS, 200: {"content": {"text/event-stream": {}},
                                      "description": "As /generate in a one-element list, or with `stream: true` "
                                                     "as /generate_stream."}},
)
async def tgi_root(body: GenerateRequest, request: Request, state: State) -> Response:
    """TGI's route for clients pointed at the server's URL (huggingface_hub's `InferenceClient(url)`):
    `stream: true` in the body answers as /generate_stream, otherwise as /generate in a one-element list."""
    if body.stream:
        return await _generate_stream(body, request, state)
    content, headers = await _generate(body, request, state, "/generate")
    if content is None:
        return disconnected_response()
    return JSONResponse([content], headers=headers)
