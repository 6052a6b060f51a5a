"""TGI-shaped generation, TEI-shaped embedding and tokenize request/response models."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from model.sampling import SamplingParams
from service.jobs import EmbeddingSpec, FinishReason, GenerationSpec
from service.protocol.common import (
    InputText,
    Limits,
    PlainText,
    RequestModel,
    ResponseModel,
    Tokenizer,
    check_batch_size,
    check_new_tokens,
    check_stop,
    check_truncate,
    encode_checked,
    fit_new_tokens,
    sampling_params,
)


class GenerateParameters(RequestModel):
    """TGI's generation parameters."""

    max_new_tokens: int | None = Field(
        None, ge=1, description="Tokens to generate at most (server default when unset; capped by the server)."
    )
    temperature: float | None = Field(None, gt=0, le=100, description="Sampling temperature (> 0).")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens (0: all).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass, in (0, 1].")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="Penalty on repeated tokens (1: none).")
    do_sample: bool = Field(False, description="Sample (true) or pick the most likely token (false).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Random seed: same seed, same tokens.")
    stop: list[str] = Field(default_factory=list, description="Stop when the text ends with one of these.")
    truncate: bool | int | None = Field(
        None,
        description="Keep only the last N input tokens (true: as many as fit, the server's input limit less "
        "the room max_new_tokens needs in the model's positions).",
    )
    details: bool = Field(False, description="Return finish reason, token counts, seed and tokens.")
    return_full_text: bool = Field(False, description="Prepend the prompt to generated_text.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-text token.")

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty strings")
        return value

    @field_validator("truncate")
    @classmethod
    def _truncate_positive(cls, value: bool | int | None) -> bool | int | None:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("must be >= 1 (or true/false)")
        return value

    def sampling(self) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_k=self.top_k or 0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            do_sample=self.do_sample,
            seed=self.seed,
        )


class GenerateRequest(RequestModel):
    """`POST /generate` and `/generate_stream` (TGI)."""

    inputs: InputText = Field(description="The prompt.")
    parameters: GenerateParameters = Field(
        default_factory=lambda: GenerateParameters.model_validate({}), description="Generation parameters."
    )
    stream: bool = Field(
        False, description="On `POST /` (TGI): true answers as /generate_stream, false as /generate. "
        "/generate and /generate_stream ignore it."
    )

    def to_spec(self, tokenizer: Tokenizer, limits: Limits) -> GenerationSpec:
        p = self.parameters
        if p.max_new_tokens is None:
            new_tokens = min(limits.default_new_tokens, limits.max_new_tokens)
        else:
            new_tokens = check_new_tokens(p.max_new_tokens, limits, "parameters.max_new_tokens")
        keep_last = check_truncate(p.truncate, limits, "parameters.truncate", new_tokens)
        ids = encode_checked(
            tokenizer, self.inputs, limits, field="inputs", keep_last=keep_last,
            truncate_hint="set parameters.truncate to keep the last tokens",
        )
        return GenerationSpec(
            prompt_ids=ids,
            sampling=p.sampling(),
            max_new_tokens=fit_new_tokens(len(ids), new_tokens, limits, explicit=p.max_new_tokens is not None,
                                          input_field="inputs", new_field="parameters.max_new_tokens"),
            stop_sequences=check_stop(p.stop, limits, "parameters.stop"),
            stop_on_eos=not p.ignore_eos,
        )


class Token(ResponseModel):
    id: int
    text: str
    logprob: float
    special: bool


class GenerateDetails(ResponseModel):
    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    seed: int | None
    tokens: list[Token]


class GenerateResponse(ResponseModel):
    generated_text: str
    details: GenerateDetails | None = None


class StreamDetails(ResponseModel):
    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    input_length: int
    seed: int | None


class StreamEvent(ResponseModel):
    """One Server-Sent Event of /generate_stream; the last carries generated_text and details."""

    index: int
    token: Token
    generated_text: str | None = None
    details: StreamDetails | None = None


class StreamError(ResponseModel):
    error: str
    error_type: str


class EmbedRequest(RequestModel):
    """`POST /embed` (TEI)."""

    inputs: InputText | list[InputText] = Field(description="A text or a list of texts.")
    normalize: bool = Field(True, description="L2-normalise each vector.")
    truncate: bool = Field(False, description="Keep the first max_input_tokens tokens of a longer input.")
    pooling: Literal["mean", "last"] = Field(
        "mean", description="Pool the hidden states by mean or last token. A mean is whitened (or, for older "
        "artifacts, standardised per dimension) with the artifact's training statistics when it ships them (see "
        "/info); the last token's state is raw.")

    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)

    def to_spec(self, tokenizer: Tokenizer, limits: Limits) -> EmbeddingSpec:
        texts = self.texts()
        check_batch_size(len(texts), limits, "inputs")
        keep = limits.max_input_tokens if self.truncate else None
        sequences = [
            encode_checked(
                tokenizer, text, limits, field="inputs" if isinstance(self.inputs, str) else f"inputs.{i}",
                keep_first=keep, truncate_hint="set truncate to true to keep the first tokens",
            )
            for i, text in enumerate(texts)
        ]
        return EmbeddingSpec(sequences=sequences, pooling=self.pooling, normalize=self.normalize)


class TokenizeRequest(RequestModel):
    """`POST /tokenize`: TGI's body; only `inputs` is used."""

    inputs: PlainText = Field(description="Text to tokenize.")


class TokenInfo(ResponseModel):
    id: int
    text: str
    start: int
    stop: int


class ErrorResponse(ResponseModel):
    """Error body of the native routes."""

    error: str
    error_type: str
