"""OpenAI-compatible `/v1/completions` (streaming too), `/v1/embeddings` and `/v1/models`."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service.api.protocol import (
    OPENAI_FINISH_REASON,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    EmbeddingData,
    EmbeddingsRequest,
    EmbeddingsResponse,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
    PromptTokensDetails,
    Usage,
)
from service.api.protocol.logprobs import completion_logprobs, prompt_texts
from service.api.routes.common import (
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
    tokenized,
    until_disconnected,
)
from service.api.routes.generate import collect_all, start_all, summed_logprob
from service.api.routes.structured import compile_constraint
from service.engine.core import GenerationStream
from service.errors import ModelNotFound, ServiceError, ValidationFailed, error_body
from service.jobs import FinishEvent, TokenEvent

router = APIRouter(prefix="/v1", tags=["openai"])
log = logging.getLogger("service.routes.openai")


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """OpenAI leaves the stop sequence (and anything after it) out of the text."""
    hits = [text.find(s) for s in stops if s in text]
    return text[: min(hits)] if hits else text


def check_model(model: str | None, state: State) -> None:
    """A request names the model it wants: this server's (or none); any other is not here (404, as vLLM)."""
    if model is not None and model != state.model_id:
        raise ModelNotFound(f"the model {model[:100]!r} does not exist; this server serves {state.model_id!r}",
                            param="model")


def note_user(user: str | None, route: str) -> None:
    """OpenAI's `user` identifies the end user for abuse monitoring: it goes into the request's log line."""
    if user is not None:
        log.info("%s for user %r", route, user[:200], extra={"end_user": user[:200]})


def _rank(results: list[tuple[list[TokenEvent], FinishEvent]], n: int) -> list[int]:
    """The n of a prompt's sequences to answer: all in order when n of n ran, else (best_of) the n of the
    highest summed logprob, best first."""
    if len(results) == n:
        return list(range(n))
    return sorted(range(len(results)), key=lambda i: -summed_logprob(results[i][0]))[:n]


@router.post("/completions", response_model=CompletionResponse, responses={
    **OPENAI_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true."}})
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    """OpenAI text completions; `stream: true` sends Server-Sent Events ending with `data: [DONE]`."""
    started = time.perf_counter()
    engine, limits, tokenizer = ready_parts(state)
    check_model(body.model, state)  # before any prompt is tokenized: a request for another model costs nothing
    await compile_constraint(state, body, ignore_eos=body.ignore_eos)
    try:
        per_prompt = await tokenized(request, state, body.to_specs, tokenizer, limits)
    except ClientDisconnected:
        return disconnected_response()
    note_user(body.user, "/v1/completions")
    if body.stream and len(per_prompt) > 1:
        raise ValidationFailed("stream supports a single prompt", param="prompt")
    specs = [spec for group in per_prompt for spec in group]
    streams = start_all(engine, specs, request, stream=body.stream, salt=body.cache_salt)
    if body.stream:
        try:
            first = await until_disconnected(request, streams[0].next_event())
        except ClientDisconnected:
            return disconnected_response()
        return EventStreamResponse(_stream(state, body, streams[0], first, tokenizer), on_close=streams[0].cancel)
    try:
        results = await until_disconnected(request, collect_all(streams))
    except ClientDisconnected:
        return disconnected_response()
    finally:
        for s in streams:
            s.cancel()
    for stream, (_, finish) in zip(streams, results, strict=True):
        observe(state, "/v1/completions", stream.timings, finish.prompt_tokens)
    choices, seeds, prompt_tokens, generated, cached = [], [], 0, 0, 0
    width = len(per_prompt[0])
    for p, group in enumerate(per_prompt):
        ran = results[p * width:(p + 1) * width]
        prompt_tokens += ran[0][1].prompt_tokens
        cached += min(f.cached_tokens for _, f in ran)  # the prompt counted once, as prompt_tokens counts it
        generated += sum(0 if body.scores_only else len(f.generated_ids) for _, f in ran)
        for j, k in enumerate(_rank(ran, body.n)):
            tokens, finish = ran[k]
            choices.append(_choice(body, tokenizer, group[k].prompt_ids, tokens, finish, p * body.n + j))
            seeds.append(finish.seed)
    response = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_id, choices=choices,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated,
                    prompt_tokens_details=PromptTokensDetails(cached_tokens=cached)),
        seeds=seeds,
    )
    headers = timing_headers(streams[0].timings, time.perf_counter() - started, prompt_tokens, generated,
                             cached_tokens=cached, report_cached=state.settings.prefix_cache_report)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


def _choice(body: CompletionRequest, tokenizer: Any, prompt_ids: list[int], tokens: list[TokenEvent],
            finish: FinishEvent, index: int) -> CompletionChoice:
    """One choice: the echoed prompt (the text of its tokens, truncation applied), the generated text cut at a
    stop sequence, and the logprobs asked for (the prompt's first with echo)."""
    scores = tokens[0].prompt_logprobs if body.echo else None
    if body.scores_only:  # the prefill's one token was only there to run it
        tokens, text, reason = [], "", "length"
    else:
        text = _cut_at_stop(finish.generated_text, body.stop_list()) if finish.finish_reason == "stop_sequence" \
            else finish.generated_text
        reason = OPENAI_FINISH_REASON[finish.finish_reason]
    prefix = "".join(prompt_texts(tokenizer, prompt_ids)) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, tokens, body.logprobs, prompt_ids=prompt_ids, scores=scores)
    return CompletionChoice(index=index, text=prefix + text, finish_reason=reason,  # type: ignore[arg-type]
                            logprobs=logprobs)


async def _stream(state: State, body: CompletionRequest, stream: GenerationStream, first: TokenEvent,
                  tokenizer: Any) -> AsyncIterator[bytes]:
    """The completion's chunks: text as it is safe to send (never part of a stop sequence), each chunk with the
    logprobs of the tokens generated since the previous chunk when asked (the echoed prompt and its scores
    with the first), and with stream_options.include_usage a last chunk holding usage and no choices."""
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    stops = body.stop_list()
    # Hold back what could be the start of a stop sequence, so that no part of one is ever sent.
    hold = max((len(s) for s in stops), default=1) - 1
    prompt_ids = stream.job.spec.prompt_ids
    echoed = "".join(prompt_texts(tokenizer, prompt_ids)) if body.echo else ""
    scores = first.prompt_logprobs if body.echo else None
    text, sent, reported = echoed, 0, 0  # reported: the characters of the tokens whose logprobs went out
    pending: list[TokenEvent] = []

    def chunk(piece: str, reason: str | None) -> bytes:
        nonlocal pending, scores, reported
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, pending, body.logprobs, offset=reported, prompt_ids=prompt_ids,
                                           scores=scores)
            reported = logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else reported
        pending, scores = [], None
        choice = CompletionChoice(index=0, text=piece, finish_reason=reason, logprobs=logprobs)  # type: ignore[arg-type]
        payload = CompletionResponse(id=completion_id, created=created, model=state.model_id, choices=[choice])
        return sse(payload.model_dump(mode="json", exclude={"usage", "seeds"}))

    event = first
    try:
        while True:
            finish = event.finish
            if not body.scores_only:
                text += event.text
                pending.append(event)
            if finish is None:
                safe = len(text) - hold
                if safe > sent:
                    yield chunk(text[sent:safe], None)
                    sent = safe
                event = await stream.next_event()
                continue
            if finish.finish_reason == "stop_sequence":
                text = echoed + _cut_at_stop(text[len(echoed):], stops)
            observe(state, "/v1/completions", stream.timings, finish.prompt_tokens)
            # scores only: the prefill's one token is dropped, so its end is not the text's
            yield chunk(text[sent:], "length" if body.scores_only else OPENAI_FINISH_REASON[finish.finish_reason])
            if body.stream_options is not None and body.stream_options.include_usage:
                made = 0 if body.scores_only else len(finish.generated_ids)
                usage = Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=made,
                              total_tokens=finish.prompt_tokens + made,
                              prompt_tokens_details=PromptTokensDetails(cached_tokens=finish.cached_tokens))
                last = CompletionResponse(id=completion_id, created=created, model=state.model_id, choices=[],
                                          usage=usage)
                yield sse(last.model_dump(mode="json", exclude={"seeds"}))
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
    check_model(body.model, state)
    try:
        spec = await tokenized(request, state, body.to_spec, tokenizer, limits, state.embedding_dim)
    except ClientDisconnected:
        return disconnected_response()
    note_user(body.user, "/v1/embeddings")
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
