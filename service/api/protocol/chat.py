"""OpenAI's `POST /v1/chat/completions` request and response models (vLLM's chat extras included).

A chat request is rendered to a prompt with the artifact's chat template (service/text/chat_template.py), then
generated exactly as `/v1/completions` generates a prompt: `completion_fields` maps the chat request's
fields onto the completions request's, so both routes share one set of sampling rules and limits."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from service.api.protocol.cache_salt import cache_salt_field
from service.api.protocol.common import PlainText, RequestModel, ResponseModel, check_encodable
from service.api.protocol.openai import BiasValue, CompletionLogprobs, StreamOptions, Usage
from service.api.protocol.structured import OPENAI_STRUCTURED_FIELDS, OpenAIStructured
from service.errors import ValidationFailed

# How deep chat_template_kwargs may nest: a template reads settings, not trees, and what walks the value
# (service/text/chat_prompt.py) must not run out of stack on a body nested as deep as the JSON parser allows.
MAX_TEMPLATE_VARIABLE_DEPTH = 32


def _shallow(value: dict[str, Any]) -> dict[str, Any]:
    """At most MAX_TEMPLATE_VARIABLE_DEPTH levels, and its strings text as the messages' are (no NUL: in
    enwik8's byte vocabulary NUL is the end-of-text id, and what the template writes is tokenized)."""
    level: list[Any] = [value]
    for _ in range(MAX_TEMPLATE_VARIABLE_DEPTH):
        items = [v for item in level for v in ([*item.keys(), *item.values()] if isinstance(item, dict) else item)]
        for item in items:
            if isinstance(item, str):
                check_encodable(item)
        level = [v for v in items if isinstance(v, (dict, list))]
        if not level:
            return value
    raise ValueError(f"must not nest more than {MAX_TEMPLATE_VARIABLE_DEPTH} levels deep")


# Further template variables (chat_template_kwargs): JSON, at most MAX_TEMPLATE_VARIABLE_DEPTH levels deep.
TemplateVariables = Annotated[dict[str, Any], AfterValidator(_shallow)]

# Roles a chat template sees; any other is refused by name.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class TextPart(RequestModel):
    """One part of a message's content; only text parts exist for a text model."""

    type: Literal["text"] = Field(description="Only `text`: this model reads no images or audio.")
    text: PlainText = Field(description="The part's text.")


class ChatMessage(RequestModel):
    role: ChatRole = Field(description="Who speaks: system, developer, user, assistant or tool.")
    content: PlainText | list[TextPart] | None = Field(
        None, description="The text, or a list of text parts (joined with newlines, as vLLM joins them).")
    name: PlainText | None = Field(None, description="A participant's name, passed to the template.")

    def template_view(self) -> dict[str, Any]:
        """The message as a chat template sees it: `role`, `content` (a string) and `name` when given."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        view: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            view["name"] = self.name
        return view


class ChatTemplateOptions(RequestModel):
    """The template-rendering fields that `/v1/chat/completions` and vLLM's `/tokenize` with `messages` share."""

    messages: list[ChatMessage] = Field(description="The conversation so far, oldest first.")
    add_generation_prompt: bool = Field(
        True, description="End the rendered prompt with the template's opening of an assistant turn.")
    continue_final_message: bool = Field(
        False, description="Leave the last (assistant) message open, for the model to continue it.")
    chat_template_kwargs: TemplateVariables | None = Field(
        None, description="Further variables for the chat template (at most 32 levels deep).")

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must hold at least one message")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_of_generation_or_continuation(cls, value: bool, info: ValidationInfo) -> bool:
        # fields validate in order: messages and add_generation_prompt are in info.data when they were valid
        check_continuation(info.data.get("messages") or [], bool(info.data.get("add_generation_prompt")), value)
        return value


def check_continuation(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """Raise ValueError when the two ways to end a rendered prompt are combined, or a continuation has no
    assistant message to continue."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt false: a prompt either opens a "
                         "new assistant turn or continues the last message, not both")
    if continue_final_message and messages and messages[-1].role != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's")


# Chat fields that share a name and meaning with the completions request: passed through as they are.
_SHARED_FIELDS = ("model", "temperature", "top_p", "top_k", "repetition_penalty", "n", "stream", "stop", "seed",
                  "ignore_eos", "user", "frequency_penalty", "presence_penalty", "logit_bias", "stream_options",
                  "truncate_prompt_tokens", "cache_salt", *OPENAI_STRUCTURED_FIELDS)


class ChatCompletionRequest(ChatTemplateOptions, OpenAIStructured):
    """`POST /v1/chat/completions`."""

    model: str | None = Field(None, description="The served model's id (/v1/models) when given; any other is 404.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most (the deprecated name).")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Tokens to generate at most. Unset (and max_tokens unset): the room the prompt "
        "leaves in the model's positions, at most the server's max_new_tokens, as vLLM.")
    temperature: float = Field(1.0, ge=0, le=2, description="0 picks the most likely token; > 0 samples.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens (0 or -1: all).")
    repetition_penalty: float = Field(1.0, gt=0, le=100, description="Penalty on repeated tokens (1: none).")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="As in /v1/completions.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="As in /v1/completions.")
    logit_bias: dict[str, BiasValue] | None = Field(None, description="As in /v1/completions.")
    n: int = Field(1, ge=1, description="Choices to generate (as in /v1/completions).")
    stream: bool = Field(False, description="Stream `chat.completion.chunk` events ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="As in /v1/completions (`include_usage`).")
    logprobs: bool = Field(False, description="Return the chosen tokens' logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token (needs logprobs).")
    stop: str | list[str] | None = Field(None, description="Stop sequences (not included in the text).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Random seed: same seed, same tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-text token.")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="Keep only the last N prompt tokens.")
    user: str | None = Field(None, description="The end user's id, written into the request's log line.")
    cache_salt: str | None = cache_salt_field()
    cache_prefix_messages: int | None = Field(
        None, ge=1, description="Extension: the first N messages, rendered alone (no generation prompt), are the "
        "prompt's cached segment, as /v1/completions' cache_prefix_chars: a conversation that keeps its first N "
        "messages (a system prompt, a document) restores their state on every turn. At most the number of "
        "messages; refused when the template does not render them as the start of the whole prompt.")

    @field_validator("cache_prefix_messages")
    @classmethod
    def _within_the_messages(cls, value: int | None, info: ValidationInfo) -> int | None:
        count = len(info.data.get("messages") or [])
        if value is not None and value > count:
            raise ValueError(f"must be at most the number of messages ({count}); got {value}")
        return value

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs true")
        return self

    def completion_fields(self, known: set[str]) -> dict[str, Any]:
        """The completions request's fields for this chat request (its prompt left out). `known`: the fields
        the completions request has; a chat field set here that it lacks is refused, never dropped."""
        body: dict[str, Any] = {}
        for name in _SHARED_FIELDS:
            if name in self.model_fields_set:
                body[name] = getattr(self, name)
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is not None:
            body["max_tokens"] = limit
        if self.logprobs:
            body["logprobs"] = self.top_logprobs or 0
        missing = sorted(set(body) - known)
        if missing:
            raise ValidationFailed(f"{missing[0]} is not supported by this server", param=missing[0])
        return body


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatTokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[dict[str, Any]]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


def chat_logprobs(logprobs: CompletionLogprobs) -> ChatLogprobs:
    """A completion's logprobs in the chat shape (one entry per token, its alternatives as a list)."""
    tops = logprobs.top_logprobs or [{} for _ in logprobs.tokens]
    content = []
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, tops, strict=True):
        content.append(ChatTokenLogprob(
            token=token, logprob=float(logprob if logprob is not None else 0.0),
            bytes=list(token.encode("utf-8", errors="surrogatepass")),
            top_logprobs=[{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", errors="surrogatepass"))}
                          for t, v in (top or {}).items()],
        ))
    return ChatLogprobs(content=content)
