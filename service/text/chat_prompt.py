"""A chat request's prompt ids: the chat template's control tokens are control, what the client wrote is text.

The template writes control tokens by their spellings (`<|im_start|>`, `{{ eos_token }}`), and the client's
messages may spell the same (`</s>`, a turn closed and a system turn opened in a user message). Before the
template sees them, every spelling of a control token in the client's strings (contents, names, template
variables) is replaced by a private-use character that stands for it; the rendered text is then cut at the
control spellings left, which only the template can have written, each encoded as its id, and the text
between them, the stand-ins put back, is encoded as text (model/tokenizers/text_only.py)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import Any

from model.tokenizer import Tokenizer
from service.errors import ValidationFailed
from service.text.chat_template import render_chat

# The Private Use Areas (Supplementary B, then A, then the BMP's): characters no text means anything by; one
# per control spelling, those that occur in neither the request nor the template. A request that uses every
# one of them (about 137,000 distinct characters) is refused: there would be no stand-in left.
_STAND_INS = (range(0x10FFFD, 0x100000, -1), range(0xFFFFD, 0xF0000, -1), range(0xF8FF, 0xDFFF, -1))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _replace(value: Any, pattern: re.Pattern[str], stand_in: dict[str, str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda m: stand_in[m.group()], value)
    if isinstance(value, dict):
        return {k: _replace(v, pattern, stand_in) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, pattern, stand_in) for v in value]
    return value


def _alternation(spellings: Any) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True)))


# A part of a chat prompt: a control token's id (the template wrote it) or text (encoded as text)
Segment = int | str


def chat_segments(tokenizer: Tokenizer, source: str | None, messages: list[dict[str, Any]], *,
                  add_generation_prompt: bool, continue_final_message: bool, bos_token: str | None,
                  eos_token: str | None, extra: dict[str, Any] | None = None) -> tuple[list[Segment], str]:
    """The prompt's parts in order, and its rendered text (the client's spellings of control tokens put back)."""
    controls = {s: i for s, i in tokenizer.control_tokens().items() if s}

    def render(msgs: list[dict[str, Any]], variables: dict[str, Any] | None) -> str:
        return render_chat(source, msgs, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, bos_token=bos_token,
                           eos_token=eos_token, extra=variables)

    if not controls:
        text = render(messages, extra)
        return ([text] if text else []), text
    used = set("".join(_strings([messages, extra, source or ""])))
    unused = (chr(c) for c in itertools.chain(*_STAND_INS) if chr(c) not in used)
    free = list(itertools.islice(unused, len(controls)))
    if len(free) < len(controls):  # (next() on an exhausted iterator here once hung the request: a
        # StopIteration cannot be set on the executor's future)
        raise ValidationFailed("messages: the request uses every private-use character, so its text cannot be "
                               "told from the template's control tokens", param="messages")
    stand_in = dict(zip(controls, free))
    spelled = _alternation(controls)
    text = render(_replace(messages, spelled, stand_in), _replace(extra, spelled, stand_in))
    back = {c: spelling for spelling, c in stand_in.items()}
    put_back = _alternation(back)

    def client_text(part: str) -> str:
        return put_back.sub(lambda m: back[m.group()], part)

    segments: list[Segment] = []
    start = 0
    for match in spelled.finditer(text):
        if match.start() > start:
            segments.append(client_text(text[start:match.start()]))
        segments.append(controls[match.group()])
        start = match.end()
    if start < len(text):
        segments.append(client_text(text[start:]))
    return segments, client_text(text)


def encode_segments(tokenizer: Tokenizer, segments: list[Segment]) -> list[int]:
    """Control ids as they are, text as text."""
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, str):
            ids.extend(tokenizer.encode(segment))
        else:
            ids.append(segment)
    return ids


def after_head(segments: list[Segment], head: list[Segment]) -> list[Segment] | None:
    """The parts of `segments` after `head`, where the prompt starts with `head` (its last text part may end
    inside one of the prompt's); None where it does not."""
    if not head:
        return list(segments)
    if len(segments) < len(head) or segments[: len(head) - 1] != head[:-1]:
        return None
    last, there = head[-1], segments[len(head) - 1]
    if last == there:
        return segments[len(head):]
    if isinstance(last, str) and isinstance(there, str) and there.startswith(last):
        return [there[len(last):], *segments[len(head):]]
    return None


def chat_prompt_ids(tokenizer: Tokenizer, source: str | None, messages: list[dict[str, Any]], *,
                    add_generation_prompt: bool, continue_final_message: bool, bos_token: str | None,
                    eos_token: str | None, extra: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """The prompt's ids and its rendered text (the client's spellings of control tokens put back)."""
    segments, text = chat_segments(tokenizer, source, messages, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, bos_token=bos_token,
                                   eos_token=eos_token, extra=extra)
    return encode_segments(tokenizer, segments), text
