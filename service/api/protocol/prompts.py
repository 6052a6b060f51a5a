"""Prompts given as text or as token ids (OpenAI's `prompt`: a text, texts, a list of ids or lists of ids):
each turned into checked token ids, ids checked against the tokenizer's vocabulary."""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from pydantic import ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from service.api.protocol.common import InputText, Limits
from service.errors import InputTooLong, ValidationFailed

SHAPES = "a text, a list of texts, a list of token ids or a list of lists of token ids"


def _kind(item: Any) -> str:
    if isinstance(item, bool) or not isinstance(item, (str, int, list)):
        return type(item).__name__ if item is not None else "null"
    if isinstance(item, list):
        return "a list of ids" if all(isinstance(i, int) and not isinstance(i, bool) for i in item) else "a list"
    return "a text" if isinstance(item, str) else "an id"


def _one_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A value of none of the shapes gets one message naming the first item that breaks the shape, instead of
    each union member's complaint; a value of the right shape that fails a check keeps its own message."""
    try:
        return handler(value)
    except ValidationError as err:
        if not all(str(e["type"]).endswith("_type") for e in err.errors()):
            raise
        where = ""
        if isinstance(value, list) and value:
            first = _kind(value[0])
            for i, item in enumerate(value):
                kind = _kind(item)
                if kind != first or kind not in ("a text", "an id", "a list of ids"):
                    where = f": item {i} is {kind}, item 0 {first}" if i else f": item 0 is {kind}"
                    break
        raise PydanticCustomError("prompt_shape", "must be {shapes}{where}", {"shapes": SHAPES, "where": where}) \
            from None


# OpenAI's `prompt`. Strict validation keeps the members apart: `true` is no id and `"5"` no list of ids.
PromptInput = Annotated[InputText | list[InputText] | list[int] | list[list[int]], WrapValidator(_one_shape)]
# One prompt: a text or its token ids.
PromptItem = str | list[int]


class PromptTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def prompt_items(prompt: PromptInput) -> list[PromptItem]:
    """The prompts of a request, each a text or a list of ids (a flat list of ids is one prompt)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]  # the check above: every member is an id
    return list(prompt)  # type: ignore[arg-type]  # texts or lists of ids


def item_fields(field: str, prompt: PromptInput) -> list[str]:
    """The name of each prompt in errors: its JSON path (`prompt` for a text or a flat list of ids, `prompt.N`
    in a list of lists of ids), except that a list of one text is named `prompt` as a text is."""
    items = prompt_items(prompt)
    nested_ids = isinstance(prompt, list) and any(isinstance(p, list) for p in prompt)
    if len(items) == 1 and not nested_ids:
        return [field]
    return [f"{field}.{i}" for i in range(len(items))]


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> list[int]:
    """Refuse an empty list or an id outside the vocabulary, naming the field (`prompt.3`)."""
    if not ids:
        raise ValidationFailed(f"{field} must not be an empty list of token ids", param=field)
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise ValidationFailed(
                f"{field}.{i}: token id {token_id} is outside the vocabulary (0 to {vocab_size - 1})",
                param=f"{field}.{i}",
            )
    return ids


def fit_prompt(ids: list[int], limits: Limits, field: str, keep_last: int | None, truncate_hint: str) -> list[int]:
    """Keep the last `keep_last` ids when asked; refuse what is still longer than the input limit."""
    if keep_last is not None and len(ids) > keep_last:
        ids = ids[-keep_last:]
    if len(ids) > limits.max_input_tokens:
        hint = f"; {truncate_hint}" if truncate_hint else ""
        raise InputTooLong(f"{field} has {len(ids)} tokens; the limit is {limits.max_input_tokens}{hint}",
                           param=field)
    return ids


def prompt_ids(item: PromptItem, tokenizer: PromptTokenizer, limits: Limits, *, field: str,
               keep_last: int | None = None, truncate_hint: str = "") -> list[int]:
    """One prompt's checked ids: a text tokenized, ids checked against the vocabulary; then truncated and
    refused when too long."""
    if isinstance(item, str):
        ids = tokenizer.encode(item)
    else:
        # a flat list of ids is named `prompt`, its ids `prompt.N`; a list of lists names `prompt.I.N`
        ids = check_token_ids(list(item), tokenizer.vocab_size, field)
    return fit_prompt(ids, limits, field, keep_last, truncate_hint)


def prompt_text(item: PromptItem, tokenizer: PromptTokenizer) -> str:
    """The text of a prompt (ids decoded), as `echo` shows it."""
    return item if isinstance(item, str) else tokenizer.decode(list(item))
