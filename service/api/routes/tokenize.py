"""`POST /tokenize` (TGI's body and answer for `inputs`; vLLM's for `prompt` or `messages`), and vLLM's
`POST /detokenize` and `GET /tokenizer_info`: the endpoints lm-eval's remote tokenizer uses."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from service.api.protocol import ErrorResponse, TokenInfo
from service.api.protocol.common import Limits, encode_checked
from service.api.protocol.prompts import check_token_ids
from service.api.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeBody,
    TokenizeResult,
    TokenizerInfo,
)
from service.api.routes.common import (
    READ_CODES,
    TOKENIZE_CODES,
    ClientDisconnected,
    State,
    disconnected_response,
    error_responses,
    ready_parts,
    tokenized,
)
from service.api.routes.openai import check_model
from service.text.chat_prompt import Segment, chat_segments, encode_segments
from service.text.tokenizing import json_array, release_in_slices

router = APIRouter(tags=["tokenizer"])

# a body may name the model (vLLM's): any but this server's is 404, as on the /v1 routes
_ERRORS = error_responses(ErrorResponse, tuple(sorted({*TOKENIZE_CODES, 404})))


def special_text(tokenizer: Any, token_id: int | None) -> str | None:
    """A special token's text as the tokenizer spells it (`</s>`), None where there is no such token."""
    return None if token_id is None else str(tokenizer.id_to_piece(token_id))


def chat_template_of(state: State) -> str | None:
    return getattr(state.artifact, "chat_template", None)


def message_segments(state: State, tokenizer: Any, body: Any) -> tuple[list[Segment], str]:
    """`body.messages` rendered with the artifact's chat template (400 naming it when there is none): its parts,
    the template's control tokens as their ids and the messages' text as text, and the rendered text."""
    return chat_segments(
        tokenizer, chat_template_of(state), [m.template_view() for m in body.messages],
        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        bos_token=special_text(tokenizer, tokenizer.bos_id), eos_token=special_text(tokenizer, tokenizer.eos_id),
        extra=body.chat_template_kwargs,
    )


def message_prompt(state: State, tokenizer: Any, body: Any) -> tuple[list[int], str]:
    """The ids of `body.messages`' prompt (message_segments encoded), and its rendered text."""
    segments, text = message_segments(state, tokenizer, body)
    return encode_segments(tokenizer, segments), text


def encode_spelled_specials(tokenizer: Any, text: str) -> list[int]:
    """Ids of `text` where a named special token spelled out (`</s>`) is its id, as a Hugging Face tokenizer
    treats its added special tokens and so vLLM's /tokenize: lm-eval finds the end-of-text id by tokenizing
    /tokenizer_info's eos_token. Everywhere else (prompts, TGI's /tokenize) text is only text."""
    named = {tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.unk_id} - {None}
    specials = {str(tokenizer.id_to_piece(i)): int(i) for i in named}
    specials.pop("", None)
    if not specials:
        return list(tokenizer.encode(text))
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            ids.extend(tokenizer.encode(text[start:match.start()]))
        ids.append(specials[match.group()])
        start = match.end()
    if start < len(text):
        ids.extend(tokenizer.encode(text[start:]))
    return ids


def with_bos(ids: list[int], tokenizer: Any, add: bool) -> list[int]:
    """The tokenizer's encode adds no special tokens; asked to, the beginning-of-text id goes first (a
    tokenizer without one, as the byte tokenizer, has none to add)."""
    bos = tokenizer.bos_id
    return [bos, *ids] if add and bos is not None else ids


def _tgi_tokens(body: TokenizeBody, tokenizer: Any, limits: Limits) -> list[dict[str, Any]]:
    assert body.inputs is not None
    encode_checked(tokenizer, body.inputs, limits, field="inputs")  # refuses what the model would refuse
    pieces = [(int(i), t, int(a), int(b)) for i, t, a, b in tokenizer.offsets(body.inputs)]
    if body.add_special_tokens is not False and tokenizer.bos_id is not None:  # TGI adds them by default
        pieces.insert(0, (int(tokenizer.bos_id), "", 0, 0))
    return [TokenInfo(id=i, text=t, start=a, stop=b).model_dump() for i, t, a, b in pieces]


@router.post("/tokenize", response_model=list[TokenInfo] | TokenizeResult, responses=_ERRORS)
async def tokenize(body: TokenizeBody, request: Request, state: State) -> Response:
    """TGI's body (`inputs`): the tokens with their text and character offsets. vLLM's (`prompt`, or
    `messages` rendered with the artifact's chat template): `tokens`, `count`, `max_model_len` and, with
    `return_token_strs`, each token's text."""
    _, limits, tokenizer = ready_parts(state)
    check_model(body.model, state)
    # tokenized and the answer rendered off the event loop: a body of max_payload_bytes is millions of tokens
    try:
        pieces = await tokenized(request, state, _tokenize_answer, body, state, tokenizer, limits)
    except ClientDisconnected:
        return disconnected_response()

    async def send() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    return StreamingResponse(send(), media_type="application/json",
                             headers={"content-length": str(sum(len(p) for p in pieces))})


def _tokenize_answer(body: TokenizeBody, state: State, tokenizer: Any, limits: Limits) -> list[bytes]:
    """/tokenize's answer, rendered as JSON in pieces."""
    if body.inputs is not None:
        return [bytes(JSONResponse(_tgi_tokens(body, tokenizer, limits)).body)]
    if body.messages is not None:
        # the ids /v1/chat/completions generates after
        ids, add_default = message_prompt(state, tokenizer, body)[0], False
    else:
        assert body.prompt is not None
        # no length limit: a client tokenizes whole documents to cut them into windows itself (lm-eval does)
        ids, add_default = encode_spelled_specials(tokenizer, body.prompt), True
    add = body.add_special_tokens if body.add_special_tokens is not None else add_default
    ids = with_bos(ids, tokenizer, add)
    strs = [str(tokenizer.id_to_piece(i)) for i in ids] if body.return_token_strs else None
    # TokenizeResult's JSON without building the model: pydantic validates and dumps millions of ids in single
    # calls that hold the GIL, and so the event loop, for about a second; json_array renders in slices
    head = f'{{"count":{len(ids)},"max_model_len":{int(limits.max_total_tokens)},"tokens":'.encode()
    pieces = [head, *json_array(ids), b',"token_strs":', *(json_array(strs) if strs is not None else [b"null"]), b"}"]
    for values in (ids, strs or []):
        release_in_slices(values)
    return pieces


@router.post("/detokenize", response_model=DetokenizeResult, responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request, state: State) -> Response:
    """The text of token ids (vLLM); ids outside the vocabulary are refused, special ids give no text."""
    _, _, tokenizer = ready_parts(state)
    check_model(body.model, state)
    try:
        result = await tokenized(request, state, _detokenize, body.tokens, tokenizer)
    except ClientDisconnected:
        return disconnected_response()
    return JSONResponse(result.model_dump(mode="json"))


def _detokenize(tokens: list[int], tokenizer: Any) -> DetokenizeResult:
    if tokens:
        check_token_ids(tokens, tokenizer.vocab_size, "tokens")
    return DetokenizeResult(prompt=tokenizer.decode(tokens))


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=error_responses(ErrorResponse, READ_CODES))
async def tokenizer_info(state: State) -> TokenizerInfo:
    """The tokenizer's special tokens (text and id), size, the model's length and the chat template (vLLM)."""
    _, limits, tokenizer = ready_parts(state)
    return TokenizerInfo(
        tokenizer_class=str(tokenizer.kind), vocab_size=int(tokenizer.vocab_size),
        model_max_length=limits.max_total_tokens,
        eos_token=special_text(tokenizer, tokenizer.eos_id), eos_token_id=int(tokenizer.eos_id),
        bos_token=special_text(tokenizer, tokenizer.bos_id), bos_token_id=tokenizer.bos_id,
        pad_token=special_text(tokenizer, tokenizer.pad_id), pad_token_id=int(tokenizer.pad_id),
        chat_template=chat_template_of(state),
    )
