"""TGI-shaped generation, TEI-shaped embedding and tokenize request/response models."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from model.sampling import SamplingParams
from service.api.protocol.cache_prefix import DESCRIPTION as CACHE_PREFIX_DESCRIPTION
from service.api.protocol.cache_prefix import split_encode
from service.api.protocol.cache_salt import cache_salt_field
from service.api.protocol.common import (
    MAX_LOGPROBS,
    InputText,
    Limits,
    RequestModel,
    ResponseModel,
    Tokenizer,
    check_batch_size,
    check_new_tokens,
    check_stop,
    check_truncate,
    choice_seeds,
    encode_checked,
    fit_new_tokens,
    sampling_params,
)
from service.api.protocol.structured import Constrained, TGIGrammar
from service.errors import ValidationFailed
from service.jobs import EmbeddingSpec, FinishReason, GenerationSpec
from service.text.structured import ConstraintSource


class GenerateParameters(Constrained):
    """TGI's generation parameters (every field of TGI's `GenerateParameters`, and `ignore_eos`)."""

    best_of: int | None = Field(
        None, ge=1, description="Sample this many sequences and answer the one of the highest summed logprob; "
        "details.best_of_sequences holds the others. Needs sampling; at most /info's max_best_of; not when "
        "streaming.")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Tokens to generate at most (server default when unset; capped by the server)."
    )
    temperature: float | None = Field(None, gt=0, le=100, description="Sampling temperature (> 0); != 1 samples.")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens (0: all); > 0 samples.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass, in (0, 1]; < 1 samples.")
    typical_p: float | None = Field(None, gt=0, le=1, description="Typical sampling mass, in (0, 1]; < 1 samples.")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="Penalty on repeated tokens (1: none).")
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted from a token's logit per time it was generated before.")
    do_sample: bool = Field(
        False, description="Sample (true) or pick the most likely token (false); a temperature != 1, top_k > 0, "
        "top_p < 1 or typical_p < 1 samples whatever this says (as TGI).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Random seed: same seed, same tokens.")
    stop: list[str] = Field(default_factory=list, description="Stop when the text ends with one of these.")
    truncate: bool | int | None = Field(
        None,
        description="Keep only the last N input tokens (true: as many as fit, the server's input limit less "
        "the room max_new_tokens needs in the model's positions).",
    )
    details: bool = Field(False, description="Return finish reason, token counts, seed and tokens.")
    cache_prefix_chars: int | None = Field(None, ge=1, description=CACHE_PREFIX_DESCRIPTION)
    cache_salt: str | None = cache_salt_field()
    decoder_input_details: bool = Field(
        False, description="With details: details.prefill holds each input token with its logprob (the first "
        "null), scored by the prompt's prefill: the one-piece forward, or under the causal prefill the logits of "
        "the decode step that reads each token.")
    top_n_tokens: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="The most likely alternatives of each generated token "
        "(details.top_tokens; each stream event's top_tokens).")
    return_full_text: bool = Field(False, description="Prepend the prompt to generated_text.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-text token.")
    watermark: bool = Field(False, description="Refused when true: this server does not watermark.")
    grammar: TGIGrammar | None = Field(
        None, description="Structured output: the text matches a JSON schema ({type: json, value: schema}) or a "
        "regular expression ({type: regex, value: pattern}).")
    adapter_id: str | None = Field(None, description="Refused when set: this server serves no adapters.")

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

    @field_validator("watermark")
    @classmethod
    def _no_watermark(cls, value: bool) -> bool:
        if value:
            raise ValueError("watermarking is not supported by this server")
        return value

    @field_validator("adapter_id")
    @classmethod
    def _no_adapter(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server serves no adapters")
        return value

    def constraint_source(self) -> ConstraintSource | None:
        return self.grammar.source("parameters.grammar") if self.grammar is not None else None

    @property
    def samples(self) -> bool:
        """TGI's rule: `do_sample`, or any warper (temperature != 1, top_k != 0, top_p < 1, typical_p < 1)."""
        return (self.do_sample or (self.temperature is not None and self.temperature != 1.0)
                or bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0)
                or (self.typical_p is not None and self.typical_p < 1.0))

    def sampling(self, seed: int | None = None) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_k=self.top_k or 0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            do_sample=self.samples,
            seed=seed if seed is not None else self.seed,
            typical_p=self.typical_p if self.typical_p is not None else 1.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            top_logprobs=self.top_n_tokens or 0,
        )

    def sequences(self, limits: Limits) -> int:
        """How many sequences `best_of` asks for (1 when unset), checked against the server's limits."""
        best_of = self.best_of or 1
        if best_of > limits.max_best_of:
            raise ValidationFailed(f"parameters.best_of must be <= {limits.max_best_of} (got {best_of})",
                                   param="parameters.best_of")
        if best_of > 1 and not self.samples:
            raise ValidationFailed("parameters.best_of > 1 needs sampling: set do_sample, or a temperature, top_k, "
                                   "top_p or typical_p that samples", param="parameters.best_of")
        return best_of


class GenerateRequest(RequestModel):
    """`POST /generate` and `/generate_stream` (TGI)."""

    inputs: InputText = Field(description="The prompt.")
    parameters: GenerateParameters = Field(
        default_factory=lambda: GenerateParameters.model_validate({}), description="Generation parameters."
    )
    stream: bool = Field(
        False, description="On `POST /` (TGI): true answers as /generate_stream, false as /generate. "
        "/generate and /generate_stream refuse a value that contradicts them."
    )

    def check_streamable(self) -> None:
        """What a stream cannot carry (TGI refuses best_of and decoder_input_details when streaming)."""
        if (self.parameters.best_of or 1) > 1:
            raise ValidationFailed("parameters.best_of > 1 is not supported when streaming tokens",
                                   param="parameters.best_of")
        if self.parameters.decoder_input_details:
            raise ValidationFailed("parameters.decoder_input_details is not supported when streaming tokens",
                                   param="parameters.decoder_input_details")

    def to_spec(self, tokenizer: Tokenizer, limits: Limits) -> GenerationSpec:
        return self.to_specs(tokenizer, limits)[0]

    def to_specs(self, tokenizer: Tokenizer, limits: Limits) -> list[GenerationSpec]:
        """One spec per sequence `best_of` asks for, each with its own seed (choice_seed of the request's)."""
        p = self.parameters
        count = p.sequences(limits)
        if p.max_new_tokens is None:
            new_tokens = min(limits.default_new_tokens, limits.max_new_tokens)
        else:
            new_tokens = check_new_tokens(p.max_new_tokens, limits, "parameters.max_new_tokens")
        keep_last = check_truncate(p.truncate, limits, "parameters.truncate", new_tokens)
        cut = None
        if p.cache_prefix_chars is not None:
            if keep_last is not None or p.decoder_input_details:
                raise ValidationFailed("parameters.cache_prefix_chars cannot be combined with parameters.truncate "
                                       "or parameters.decoder_input_details", param="parameters.cache_prefix_chars")
            ids, cut = split_encode(tokenizer, self.inputs, p.cache_prefix_chars, limits, field="inputs",
                                    param="parameters.cache_prefix_chars")
        else:
            ids = encode_checked(
                tokenizer, self.inputs, limits, field="inputs", keep_last=keep_last,
                truncate_hint="set parameters.truncate to keep the last tokens",
            )
        max_new = fit_new_tokens(len(ids), new_tokens, limits, explicit=p.max_new_tokens is not None,
                                 input_field="inputs", new_field="parameters.max_new_tokens")
        stop = check_stop(p.stop, limits, "parameters.stop")
        seeds = choice_seeds(p.seed, count)
        prompt_logprobs = 0 if p.details and p.decoder_input_details else None
        return [GenerationSpec(prompt_ids=ids, sampling=p.sampling(seed), max_new_tokens=max_new,
                               stop_sequences=stop, stop_on_eos=not p.ignore_eos, stop_at_end=True,
                               prompt_logprobs=prompt_logprobs, cache_prefix_tokens=cut,
                               constraint=p.compiled_constraint)
                for seed in seeds]


class Token(ResponseModel):
    id: int
    text: str
    logprob: float
    special: bool


class PrefillToken(ResponseModel):
    """An input token in details.prefill: its logprob given the tokens before it (null for the first)."""

    id: int
    text: str
    logprob: float | None


class BestOfSequence(ResponseModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class GenerateDetails(ResponseModel):
    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    cached_tokens: int = Field(0, description="Of prompt_tokens, those not prefilled: restored from the prefix "
                               "cache or shared with an identical prompt (extension).")
    seed: int | None
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(ResponseModel):
    generated_text: str
    details: GenerateDetails | None = None


class StreamDetails(ResponseModel):
    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    cached_tokens: int = Field(0, description="As GenerateDetails.cached_tokens.")
    input_length: int
    seed: int | None


class StreamEvent(ResponseModel):
    """One Server-Sent Event of /generate_stream; the last carries generated_text and details."""

    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class StreamError(ResponseModel):
    error: str
    error_type: str


class EmbedRequest(RequestModel):
    """`POST /embed` (TEI)."""

    inputs: InputText | list[InputText] = Field(description="A text or a list of texts.")
    normalize: bool = Field(True, description="L2-normalise each vector.")
    truncate: bool = Field(False, description="Keep max_input_tokens tokens of a longer input (which: "
                           "truncation_direction).")
    truncation_direction: Literal["right", "left", "Right", "Left"] = Field(
        "right", description="With truncate: cut the right end (keep the first tokens) or the left (keep the last).")
    prompt_name: str | None = Field(None, description="Refused when set: this server has no named prompts.")
    pooling: Literal["mean", "last"] = Field(
        "mean", description="Pool the hidden states by mean or last token. A mean is whitened (or, for older "
        "artifacts, standardised per dimension) with the artifact's training statistics when it ships them (see "
        "/info); the last token's state is raw.")

    @field_validator("prompt_name")
    @classmethod
    def _no_prompt_name(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server has no named prompts")
        return value

    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)

    def to_spec(self, tokenizer: Tokenizer, limits: Limits) -> EmbeddingSpec:
        texts = self.texts()
        check_batch_size(len(texts), limits, "inputs")
        keep = limits.max_input_tokens if self.truncate else None
        left = self.truncation_direction.lower() == "left"
        sequences = [
            encode_checked(
                tokenizer, text, limits, field="inputs" if isinstance(self.inputs, str) else f"inputs.{i}",
                keep_first=None if left else keep, keep_last=keep if left else None,
                truncate_hint="set truncate to true to keep the first tokens",
            )
            for i, text in enumerate(texts)
        ]
        return EmbeddingSpec(sequences=sequences, pooling=self.pooling, normalize=self.normalize)


class TokenInfo(ResponseModel):
    id: int
    text: str
    start: int
    stop: int


class ErrorResponse(ResponseModel):
    """Error body of the native routes."""

    error: str
    error_type: str
