"""Token-level answers in each API's shape: TGI's tokens, top tokens and prefill, OpenAI's completion
logprobs (generated tokens, and with echo the prompt's, the first without a logprob)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.api.protocol.native import PrefillToken, Token
from service.api.protocol.openai import CompletionLogprobs
from service.jobs import Alternatives, PromptLogprobs, TokenEvent


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text on its own (TGI's alternatives): empty for a special token, as generated ones are."""
    return "" if tokenizer.is_special(token_id) else str(tokenizer.decode([token_id]))


def token_key(tokenizer: Any, token_id: int) -> str:
    """A token's name in OpenAI's top_logprobs: its text, or where that is empty or not text on its own (a
    special token, part of a UTF-8 character) its piece (`<0xE2>`), so no two alternatives share a key."""
    text = token_text(tokenizer, token_id)
    return text if text and "\ufffd" not in text else str(tokenizer.id_to_piece(token_id))


def prompt_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each prompt token's text as the incremental decoder completes it (empty inside a multi-byte character;
    joined, the prompt's text)."""
    decoder = tokenizer.incremental_decoder()
    texts = ["" if tokenizer.is_special(i) else str(decoder.push(i)) for i in ids]
    if texts:
        texts[-1] += str(decoder.flush())
    return texts


def tgi_token(event: TokenEvent) -> Token:
    return Token(id=event.id, text=event.text, logprob=event.logprob, special=event.special)


def tgi_top_tokens(tokenizer: Any, top: Alternatives) -> list[Token]:
    return [Token(id=i, text=token_text(tokenizer, i), logprob=v, special=bool(tokenizer.is_special(i)))
            for i, v in top]


def tgi_prefill(tokenizer: Any, ids: Sequence[int], scores: PromptLogprobs | None) -> list[PrefillToken]:
    """TGI's details.prefill: every input token with its logprob given the ones before (the first null)."""
    if scores is None:
        return []
    texts = prompt_texts(tokenizer, ids)
    logprobs: list[float | None] = [None, *scores.logprobs]
    return [PrefillToken(id=i, text=t, logprob=v) for i, t, v in zip(ids, texts, logprobs, strict=True)]


def _top_dict(tokenizer: Any, top: Alternatives, chosen: int, chosen_logprob: float) -> dict[str, float]:
    """OpenAI's top_logprobs entry: the alternatives by `token_key`, and always the chosen token (up to N+1)."""
    out = {token_key(tokenizer, i): v for i, v in top}
    out.setdefault(token_key(tokenizer, chosen), chosen_logprob)
    return out


def completion_logprobs(tokenizer: Any, tokens: Sequence[TokenEvent], top_n: int, offset: int = 0,
                        prompt_ids: Sequence[int] = (), scores: PromptLogprobs | None = None) -> CompletionLogprobs:
    """OpenAI's logprobs of a choice: with `scores` (echo) the `prompt_ids` tokens first, scored by the prefill
    (the first null), then the generated `tokens`; text offsets count from `offset`; `top_n` > 0 adds each
    token's alternatives."""
    texts: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if scores is not None:
        prompt_text = prompt_texts(tokenizer, prompt_ids)
        texts.extend(prompt_text)
        values.extend([None, *scores.logprobs])
        tops.append(None)
        for token_id, value, top in zip(prompt_ids[1:], scores.logprobs, scores.top, strict=True):
            tops.append(_top_dict(tokenizer, top, token_id, value))
    for event in tokens:
        texts.append(event.text)
        values.append(event.logprob)
        tops.append(_top_dict(tokenizer, event.top, event.id, event.logprob))
    offsets, position = [], offset
    for text in texts:
        offsets.append(position)
        position += len(text)
    return CompletionLogprobs(tokens=texts, token_logprobs=values, text_offset=offsets,
                              top_logprobs=tops if top_n > 0 else None)
