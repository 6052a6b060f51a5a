"""Pieces shared by the request models: tolerant base model, checked text, limits, tokenizing with limits."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from model.sampling import SamplingParams, choice_seed
from model.tokenizer import Tokenizer  # the artifact's tokenizer, whatever its kind
from service.errors import InputTooLong, ValidationFailed


class RequestModel(BaseModel):
    """Request base: a field the model does not declare is refused by name (a parameter a client sends is
    honoured or refused, never ignored: service/api/protocol/parameters.py lists them all); NaN and infinities
    are refused, and so are values of the wrong JSON type (strict: `true` is not a number and `"5"` is not an
    integer, as the published schema says)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_text(value: str) -> str:
    if not value.strip():
        raise ValueError("must contain text (it is empty or only whitespace)")
    return check_encodable(value)


def check_encodable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"is not valid Unicode (lone surrogate at character {err.start})") from None
    return value


# Text the model is asked about: non-empty, UTF-8 encodable, no NUL. NUL in text is nearly always binary
# data sent by mistake, and in enwik8-style vocabularies byte 0 shares its id with end-of-text.
InputText = Annotated[str, AfterValidator(_check_text)]
# Text only tokenized: may be empty, still UTF-8 encodable without NUL.
PlainText = Annotated[str, AfterValidator(check_encodable)]


@dataclass(frozen=True)
class Limits:
    """The limits a request is checked against (from Settings and the model)."""

    max_input_tokens: int
    max_new_tokens: int
    default_new_tokens: int
    max_stop_sequences: int
    max_client_batch_size: int
    # The model's position limit (max_position_embeddings): a prompt and the tokens generated after it must
    # fit in it together (TGI's max_total_tokens; vLLM's max_model_len).
    max_total_tokens: int
    # sequences one prompt may ask for (TGI's best_of, OpenAI's n and best_of): each is a generation of its own
    max_best_of: int = 4


# Alternatives per token at most (OpenAI's logprobs, TGI's top_n_tokens; vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def check_batch_size(count: int, limits: Limits, field: str) -> None:
    if count > limits.max_client_batch_size:
        raise ValidationFailed(
            f"{field} has {count} items; at most {limits.max_client_batch_size} are allowed per request",
            param=field,
        )
    if count == 0:
        raise ValidationFailed(f"{field} must not be an empty list", param=field)


def check_new_tokens(value: int, limits: Limits, field: str) -> int:
    if value > limits.max_new_tokens:
        raise ValidationFailed(f"{field} must be <= {limits.max_new_tokens} (got {value})", param=field)
    return value


def check_stop(stop: list[str], limits: Limits, field: str) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_sequences:
        raise ValidationFailed(
            f"{field} has {len(stop)} stop sequences; at most {limits.max_stop_sequences} are allowed",
            param=field,
        )
    return tuple(stop)


def encode_checked(
    tokenizer: Tokenizer, text: str, limits: Limits, *, field: str, keep_last: int | None = None,
    keep_first: int | None = None, truncate_hint: str = "",
) -> list[int]:
    """Tokenize, truncate when asked (keep the last or first N tokens), refuse what is still too long."""
    ids = tokenizer.encode(text)
    if keep_last is not None and len(ids) > keep_last:
        ids = ids[-keep_last:]
    if keep_first is not None and len(ids) > keep_first:
        ids = ids[:keep_first]
    if len(ids) > limits.max_input_tokens:
        hint = f"; {truncate_hint}" if truncate_hint else ""
        raise InputTooLong(
            f"{field} has {len(ids)} tokens; the limit is {limits.max_input_tokens}{hint}", param=field
        )
    return ids


def check_truncate(value: bool | int | None, limits: Limits, field: str, new_tokens: int) -> int | None:
    """A TGI-style `truncate` as a token count, or None: N keeps the last N tokens; true keeps as many as fit,
    the input limit less what the `new_tokens` to generate need of the model's positions."""
    if value is None or value is False:
        return None
    if value is True:
        room = limits.max_total_tokens - new_tokens
        return min(limits.max_input_tokens, room) if room >= 1 else limits.max_input_tokens
    if value > limits.max_input_tokens:
        raise ValidationFailed(f"{field} must be <= {limits.max_input_tokens} (got {value})", param=field)
    return int(value)


def fit_new_tokens(prompt_tokens: int, new_tokens: int, limits: Limits, *, explicit: bool, input_field: str,
                   new_field: str) -> int:
    """The tokens to generate after a prompt, so that prompt + generation fit in the model's positions.

    As TGI: a request that asked for `new_tokens` explicitly and does not fit is refused (422), never cut
    short or left to fail in the model; a default is lowered to what fits (TGI fills the remaining room
    when max_new_tokens is unset), and refused only when no room is left at all."""
    room = limits.max_total_tokens - prompt_tokens
    if new_tokens <= room:
        return new_tokens
    if not explicit and room >= 1:
        return room
    asked = f"{new_field}={new_tokens}" + ("" if explicit else " (the default)")
    raise InputTooLong(
        f"{input_field} tokens + {new_field} must be <= {limits.max_total_tokens} (the model's "
        f"max_position_embeddings); given {prompt_tokens} {input_field} tokens and {asked}: shorten the "
        f"input, lower {new_field} or truncate the input",
        param=new_field,
    )


# Below these the sampler's float32 arithmetic breaks down (a temperature or penalty that rounds to 0 makes
# logits infinite, a top_p that rounds to 0 drops every token): found by fuzzing, as 500s and NaN logprobs.
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's convention: a smaller temperature means greedy
MIN_TOP_P = 1e-6  # keeps only the most likely token for any vocabulary under a million, as any smaller value
MIN_REPETITION_PENALTY = 1e-6


def sampling_params(*, temperature: float, top_k: int, top_p: float, repetition_penalty: float, do_sample: bool,
                    seed: int | None, typical_p: float = 1.0, frequency_penalty: float = 0.0,
                    presence_penalty: float = 0.0, logit_bias: tuple[tuple[int, float], ...] = (),
                    top_logprobs: int = 0) -> SamplingParams:
    """SamplingParams from a request's (already range-checked) values, with the float32 floors above."""
    if temperature < GREEDY_BELOW_TEMPERATURE:
        temperature, do_sample = 1.0, False
    return SamplingParams(
        temperature=temperature, top_k=top_k, top_p=max(top_p, MIN_TOP_P),
        repetition_penalty=max(repetition_penalty, MIN_REPETITION_PENALTY), do_sample=do_sample, seed=seed,
        typical_p=max(typical_p, MIN_TOP_P), frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        logit_bias=logit_bias, top_logprobs=top_logprobs,
    )


def choice_seeds(seed: int | None, count: int) -> list[int | None]:
    """The seeds of a request's `count` sequences: one sequence keeps the request's seed (None: the sampler
    draws one); several derive theirs from it (model/sampling.py choice_seed), from a drawn one when unset, so
    each sequence is reproduced alone by a request with its seed."""
    if count == 1:
        return [seed]
    base = seed if seed is not None else random.randrange(2**63)
    return [choice_seed(base, i) for i in range(count)]
