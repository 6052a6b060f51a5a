"""OpenAI-compatible `/v1/completions`, `/v1/embeddings` and `/v1/models` models (vLLM's extras included)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from service.errors import ValidationFailed
from service.jobs import EmbeddingSpec, GenerationSpec
from service.protocol.common import (
    InputText,
    Limits,
    RequestModel,
    ResponseModel,
    Tokenizer,
    check_batch_size,
    check_new_tokens,
    check_stop,
    encode_checked,
    fit_new_tokens,
    sampling_params,
)

OPENAI_DEFAULT_MAX_TOKENS = 16

# Our finish reasons in OpenAI's words.
OPENAI_FINISH_REASON = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


class CompletionRequest(RequestModel):
    """`POST /v1/completions`."""

    model: str | None = Field(None, description="Accepted and ignored: this server serves one model.")
    prompt: InputText | list[InputText] = Field(description="A prompt or a list of prompts.")
    max_tokens: int | None = Field(
        None, ge=1, description="Tokens to generate at most (16 when unset, as OpenAI; capped by the server)."
    )
    temperature: float = Field(1.0, ge=0, le=2, description="0 picks the most likely token; > 0 samples.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens (0 or -1: all).")
    repetition_penalty: float = Field(1.0, gt=0, le=100, description="Penalty on repeated tokens (1: none).")
    n: int = Field(1, ge=1, le=1, description="Completions per prompt; only 1 is supported.")
    stream: bool = Field(False, description="Stream Server-Sent Events ending with `data: [DONE]`.")
    logprobs: int | None = Field(None, ge=0, le=1, description="Return the chosen tokens' logprobs (0 or 1).")
    echo: bool = Field(False, description="Prepend the prompt to the completion text.")
    stop: str | list[str] | None = Field(None, description="Stop sequences (not included in the text).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Random seed: same seed, same tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-text token.")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="Keep only the last N prompt tokens.")
    user: str | None = Field(None, description="Accepted and ignored.")

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty strings")
        return value

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def to_specs(self, tokenizer: Tokenizer, limits: Limits) -> list[GenerationSpec]:
        prompts = self.prompts()
        check_batch_size(len(prompts), limits, "prompt")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens > limits.max_input_tokens:
            raise ValidationFailed(
                f"truncate_prompt_tokens must be <= {limits.max_input_tokens} (got {self.truncate_prompt_tokens})",
                param="truncate_prompt_tokens",
            )
        # An unset max_tokens must not be refused by a server whose limit is under OpenAI's default.
        max_new = (min(OPENAI_DEFAULT_MAX_TOKENS, limits.max_new_tokens) if self.max_tokens is None
                   else check_new_tokens(self.max_tokens, limits, "max_tokens"))
        stop = check_stop(self.stop_list(), limits, "stop")
        sampling = sampling_params(
            temperature=self.temperature if self.temperature > 0 else 1.0,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            do_sample=self.temperature > 0,
            seed=self.seed,
        )
        specs = []
        for i, text in enumerate(prompts):
            ids = encode_checked(
                tokenizer, text, limits, field="prompt" if len(prompts) == 1 else f"prompt.{i}",
                keep_last=self.truncate_prompt_tokens, truncate_hint="set truncate_prompt_tokens to keep the last",
            )
            new_tokens = fit_new_tokens(len(ids), max_new, limits, explicit=self.max_tokens is not None,
                                        input_field="prompt" if len(prompts) == 1 else f"prompt.{i}",
                                        new_field="max_tokens")
            specs.append(GenerationSpec(ids, sampling, new_tokens, stop, stop_on_eos=not self.ignore_eos))
        return specs


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingsRequest(RequestModel):
    """`POST /v1/embeddings`."""

    input: InputText | list[InputText] = Field(description="A text or a list of texts.")
    model: str | None = Field(None, description="Accepted and ignored: this server serves one model.")
    encoding_format: Literal["float", "base64"] = Field("float", description="Floats, or base64 little-endian f32.")
    dimensions: int | None = Field(None, ge=1, description="Must be unset or equal to the model's dimension.")
    user: str | None = Field(None, description="Accepted and ignored.")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    def to_spec(self, tokenizer: Tokenizer, limits: Limits, dimension: int) -> EmbeddingSpec:
        if self.dimensions is not None and self.dimensions != dimension:
            raise ValidationFailed(
                f"dimensions must be {dimension} for this model (got {self.dimensions})", param="dimensions"
            )
        texts = self.texts()
        check_batch_size(len(texts), limits, "input")
        sequences = [
            encode_checked(tokenizer, t, limits, field="input" if len(texts) == 1 else f"input.{i}")
            for i, t in enumerate(texts)
        ]
        return EmbeddingSpec(sequences=sequences, pooling="mean", normalize=True)


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingsResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "reformer-serve"
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(ResponseModel):
    """Error body of the /v1 routes."""

    error: OpenAIErrorDetail
