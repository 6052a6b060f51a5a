"""Rendering an artifact's chat template: Jinja in an immutable sandbox, with the variables and helpers a
Hugging Face chat template expects (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
`raise_exception`, `strftime_now`, the `tojson` filter), as transformers renders it."""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.errors import ValidationFailed

# The variables a request may not set through chat_template_kwargs: the service sets them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


class TemplateRaised(Exception):
    """A template called raise_exception: its message is meant for the client."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping (Jinja's own escapes <, > and &, which a prompt must not)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """The compiled template; raises jinja2.TemplateSyntaxError for a template that does not parse."""
    return _environment().from_string(source)


def render_chat(source: str | None, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool, bos_token: str | None, eos_token: str | None,
                extra: dict[str, Any] | None = None) -> str:
    """The prompt for `messages`. No template: 400 naming it, as vLLM answers. A template that raises (its
    raise_exception, or an error rendering these messages) is the request's fault: 400 naming `messages`."""
    if source is None:
        raise ValidationFailed(
            "this model has no chat template: its artifact was exported without one (reformer export "
            "--chat-template FILE adds one); use /v1/completions with a prompt instead", param="messages")
    clash = sorted(RESERVED_VARIABLES & set(extra or {}))
    if clash:
        raise ValidationFailed(f"chat_template_kwargs must not set {clash[0]}: the server sets it",
                               param="chat_template_kwargs")
    variables = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                 "bos_token": bos_token or "", "eos_token": eos_token or ""}
    try:
        text = str(compile_template(source).render(**variables))
    except TemplateRaised as err:
        raise ValidationFailed(f"the chat template refused these messages: {err}", param="messages") from err
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        raise ValidationFailed(f"the chat template could not render these messages: {err}",
                               param="messages") from err
    if continue_final_message:
        # the last message stays open: cut the text after its content, as transformers does
        final = messages[-1]["content"]
        end = text.rfind(final) if final else -1
        if final and end == -1:
            raise ValidationFailed("continue_final_message: the template does not show the last message's "
                                   "content as given", param="continue_final_message")
        if final:
            text = text[: end + len(final)]
    return text
