"""OpenAI-compatible `/v1/completions` (streaming too), `/v1/embeddings` and `/v1/models`."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service.engine import GenerationStream
from service.errors import ServiceError, ValidationFailed, error_body
from service.jobs import FinishEvent, TokenEvent
from service.protocol import (
    OPENAI_FINISH_REASON,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    EmbeddingData,
    EmbeddingsRequest,
    EmbeddingsResponse,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
    Usage,
)
from service.routes.common import (
    OPENAI_ERRORS,
    READ_CODES,
    ClientDisconnected,
    EventStreamResponse,
    State,
    disconnected_response,
    error_responses,
    observe,
    ready_parts,
    reservation_of,
    sse,
    timing_headers,
    until_disconnected,
)
from service.routes.generate import collect

router = APIRouter(prefix="/v1", tags=["openai"])
log = logging.getLogger("service.routes.openai")


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """OpenAI leaves the stop sequence (and anything after it) out of the text."""
    hits = [text.find(s) for s in stops if s in text]
    return text[: min(hits)] if hits else text


def _logprobs(tokens: list[TokenEvent], offset: int) -> CompletionLogprobs:
    offsets, position = [], offset
    for t in tokens:
        offsets.append(position)
        position += len(t.text)
    return CompletionLogprobs(tokens=[t.text for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              text_offset=offsets)


@router.post("/completions", response_model=CompletionResponse, responses={
    **OPENAI_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true."}})
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    """OpenAI text completions; `stream: true` sends Server-Sent Events ending with `data: [DONE]`."""
    started = time.perf_counter()
    engine, limits, tokenizer = ready_parts(state)
    specs = body.to_specs(tokenizer, limits)
    if body.stream and len(specs) > 1:
        raise ValidationFailed("stream supports a single prompt", param="prompt")
    streams = []
    try:
        for spec in specs:
            streams.append(engine.generate(spec, reservation=reservation_of(request), stream=body.stream))
    except ServiceError:
        for s in streams:
            s.cancel()
        raise
    if body.stream:
        try:
            first = await until_disconnected(request, streams[0].next_event())
        except ClientDisconnected:
            return disconnected_response()
        return EventStreamResponse(_stream(state, body, streams[0], first))
    try:
        results = await until_disconnected(request, asyncio.gather(*(collect(s) for s in streams)))
    except ClientDisconnected:
        return disconnected_response()
    finally:
        for s in streams:
            s.cancel()
    choices, prompt_tokens, generated = [], 0, 0
    for index, ((tokens, finish), prompt, stream) in enumerate(zip(results, body.prompts(), streams, strict=True)):
        observe(state, "/v1/completions", stream.timings, finish.prompt_tokens)
        text = _cut_at_stop(finish.generated_text, body.stop_list()) if finish.finish_reason == "stop_sequence" \
            else finish.generated_text
        prefix = prompt if body.echo else ""
        choices.append(CompletionChoice(
            index=index, text=prefix + text, finish_reason=OPENAI_FINISH_REASON[finish.finish_reason],  # type: ignore[arg-type]
            logprobs=_logprobs(tokens, len(prefix)) if body.logprobs is not None else None,
        ))
        prompt_tokens += finish.prompt_tokens
        generated += len(finish.generated_ids)
    response = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_id, choices=choices,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated),
    )
    headers = timing_headers(streams[0].timings, time.perf_counter() - started, prompt_tokens, generated)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


async def _stream(state: State, body: CompletionRequest, stream: GenerationStream,
                  first: TokenEvent) -> AsyncIterator[bytes]:
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    stops = body.stop_list()
    # Hold back what could be the start of a stop sequence, so that no part of one is ever sent.
    hold = max((len(s) for s in stops), default=1) - 1
    text, sent = body.prompt if body.echo and isinstance(body.prompt, str) else "", 0

    def chunk(piece: str, finish: FinishEvent | None) -> bytes:
        reason = OPENAI_FINISH_REASON[finish.finish_reason] if finish else None
        choice = CompletionChoice(index=0, text=piece, finish_reason=reason)  # type: ignore[arg-type]
        payload = CompletionResponse(id=completion_id, created=created, model=state.model_id, choices=[choice])
        return sse(payload.model_dump(mode="json", exclude={"usage"}))

    event = first
    try:
        while True:
            text += event.text
            if event.finish is None:
                safe = len(text) - hold
                if safe > sent:
                    yield chunk(text[sent:safe], None)
                    sent = safe
                event = await stream.next_event()
                continue
            if event.finish.finish_reason == "stop_sequence":
                text = _cut_at_stop(text, stops)
            observe(state, "/v1/completions", stream.timings, event.finish.prompt_tokens)
            yield chunk(text[sent:], event.finish)
            break
    except ServiceError as error:
        yield sse(error_body("/v1", error.error_type, error.message, error.status_code, error.param))
    except Exception:
        log.exception("completion stream failed")
        yield sse(error_body("/v1", "internal", "internal error; the server log has the details", 500))
    finally:
        stream.cancel()
    yield sse("[DONE]")


@router.post("/embeddings", response_model=EmbeddingsResponse, responses=OPENAI_ERRORS)
async def embeddings(body: EmbeddingsRequest, request: Request, state: State) -> Response:
    """OpenAI embeddings (mean pooling, L2-normalised)."""
    started = time.perf_counter()
    engine, limits, tokenizer = ready_parts(state)
    spec = body.to_spec(tokenizer, limits, state.embedding_dim)
    try:
        result = await until_disconnected(request, engine.embed(spec, reservation=reservation_of(request)))
    except ClientDisconnected:
        return disconnected_response()
    observe(state, "/v1/embeddings", result.timings, result.prompt_tokens)
    data = []
    for index, vector in enumerate(result.vectors):
        encoded: list[float] | str = vector
        if body.encoding_format == "base64":
            encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append(EmbeddingData(embedding=encoded, index=index))
    response = EmbeddingsResponse(data=data, model=state.model_id, usage=Usage(
        prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens))
    headers = timing_headers(result.timings, time.perf_counter() - started, result.prompt_tokens)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


@router.get("/models", response_model=ModelList, responses=error_responses(OpenAIErrorResponse, READ_CODES))
async def models(state: State) -> ModelList:
    """The one model this server serves."""
    _, limits, _ = ready_parts(state)
    card = ModelCard(id=state.model_id, created=state.created, max_model_len=limits.max_total_tokens)
    return ModelList(data=[card])
