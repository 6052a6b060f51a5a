"""`cache_prefix_chars`: the part of a text prompt a request declares as its cached segment (an extension, in
the spirit of Anthropic's `cache_control` breakpoints). The prompt's first N characters (Unicode code points)
are tokenized on their own and prefilled in one forward, their decode state kept in the prefix cache; the
characters after them are tokenized on their own too and fed as decode steps (service/engine/prompt_reuse.py). Every
request that sends the same first N characters then reuses that state, whatever follows."""

from __future__ import annotations

from model.tokenizer import Tokenizer
from service.api.protocol.common import Limits
from service.errors import InputTooLong, ValidationFailed

DESCRIPTION = ("Extension: the prompt's first N characters (Unicode code points) are its cached segment, "
               "tokenized alone, prefilled in one forward and kept in the prefix cache; the rest is read "
               "after it as decode steps. Later requests that start with the same N characters restore that "
               "state instead of prefilling it. 1 <= N <= the prompt's length; not with truncation or prompt "
               "scoring.")


def split_encode(tokenizer: Tokenizer, text: str, chars: int, limits: Limits, *, field: str, param: str,
                 truncate_hint: str = "") -> tuple[list[int], int]:
    """The prompt's ids tokenized in two parts at `chars`, and the first part's token count; refuses an
    out-of-range `chars` (by `param`) and, as `encode_checked` does, a prompt over the input limit."""
    if not 1 <= chars <= len(text):
        raise ValidationFailed(f"{param} must be between 1 and the prompt's length in characters ({len(text)}); "
                               f"got {chars}", param=param)
    head = tokenizer.encode(text[:chars])
    if not head:
        raise ValidationFailed(f"{param}: the prompt's first {chars} characters make no tokens", param=param)
    tail = tokenizer.encode(text[chars:]) if chars < len(text) else []
    ids = head + tail
    if len(ids) > limits.max_input_tokens:  # the refusal a prompt without the field gets
        hint = f"; {truncate_hint}" if truncate_hint else ""
        raise InputTooLong(f"{field} has {len(ids)} tokens; the limit is {limits.max_input_tokens}{hint}",
                           param=field)
    return ids, len(head)
