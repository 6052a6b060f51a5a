"""`POST /tokenize` in TGI's shape (`inputs`) and vLLM's (`prompt`, or `messages` through the chat template),
`POST /detokenize` and `GET /tokenizer_info` in vLLM's shapes: what lm-eval's remote tokenizer calls."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from service.api.protocol.chat import ChatMessage, TemplateVariables, check_continuation
from service.api.protocol.common import PlainText, RequestModel, ResponseModel


class TokenizeBody(RequestModel):
    """`POST /tokenize`: exactly one of `inputs` (TGI: the tokens with their text and character offsets),
    `prompt` or `messages` (vLLM: the ids, their count and the model's length)."""

    inputs: PlainText | None = Field(None, description="TGI: text to tokenize; answers a list of tokens.")
    prompt: PlainText | None = Field(
        None, description="vLLM: text to tokenize; answers `tokens` and `count`. A special token spelled out "
        "(`/tokenizer_info`'s eos_token) is its id, as vLLM's Hugging Face tokenizers treat their special tokens.")
    messages: list[ChatMessage] | None = Field(
        None, description="vLLM: a conversation, rendered with the artifact's chat template, then tokenized.")
    add_special_tokens: bool | None = Field(
        None, description="Put the tokenizer's beginning-of-text token first when it has one (the byte tokenizer "
        "has none); default true for `inputs` (as TGI) and `prompt`, false for `messages` (as vLLM).")
    add_generation_prompt: bool = Field(True, description="With `messages`: as in /v1/chat/completions.")
    continue_final_message: bool = Field(False, description="With `messages`: as in /v1/chat/completions.")
    chat_template_kwargs: TemplateVariables | None = Field(
        None, description="With `messages`: further variables for the chat template (at most 32 levels deep).")
    return_token_strs: bool = Field(False, description="vLLM: also answer each token's text (`token_strs`).")
    model: str | None = Field(None, description="The served model's id (/v1/models) when given; any other is 404.")

    @field_validator("continue_final_message")
    @classmethod
    def _continuation(cls, value: bool, info: ValidationInfo) -> bool:
        messages = info.data.get("messages")
        if messages:
            check_continuation(messages, bool(info.data.get("add_generation_prompt")), value)
        return value

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        given = [name for name in ("inputs", "prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("send exactly one of inputs (TGI), prompt or messages (vLLM); got "
                             + (", ".join(given) if given else "none"))
        if self.messages is not None and not self.messages:
            raise ValueError("messages must hold at least one message")
        if self.inputs is not None:
            vllm_only = [name for name in ("return_token_strs", "chat_template_kwargs",
                                           "add_generation_prompt", "continue_final_message")
                         if name in self.model_fields_set]
            if vllm_only:
                raise ValueError(f"{vllm_only[0]} goes with prompt or messages (vLLM's body), not inputs")
        if self.prompt is not None:
            chat_only = [name for name in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
                         if name in self.model_fields_set]
            if chat_only:
                raise ValueError(f"{chat_only[0]} goes with messages, not prompt")
        return self


class TokenizeResult(ResponseModel):
    """vLLM's answer to `/tokenize`."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """`POST /detokenize` (vLLM)."""

    tokens: list[int] = Field(description="Token ids to turn back into text (special ids give no text).")
    model: str | None = Field(None, description="The served model's id (/v1/models) when given; any other is 404.")


class DetokenizeResult(ResponseModel):
    prompt: str


class TokenizerInfo(ResponseModel):
    """vLLM's `/tokenizer_info`: the tokenizer's special tokens (their text and id), size and chat template."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    eos_token: str | None
    eos_token_id: int
    bos_token: str | None
    bos_token_id: int | None
    pad_token: str | None
    pad_token_id: int
    chat_template: str | None
