"""OpenAI-compatible `/v1/completions`, `/v1/embeddings` and `/v1/models` models (vLLM's extras included)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator

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
    choice_seeds,
    encode_checked,
    fit_new_tokens,
    sampling_params,
)
from service.api.protocol.prompts import (
    PromptInput,
    PromptTokenizer,
    item_fields,
    prompt_ids,
    prompt_items,
    prompt_text,
)
from service.api.protocol.structured import OpenAIStructured
from service.errors import ValidationFailed
from service.jobs import EmbeddingSpec, GenerationSpec

OPENAI_DEFAULT_MAX_TOKENS = 16

# Our finish reasons in OpenAI's words.
OPENAI_FINISH_REASON = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="End the stream with a chunk holding `usage` and no choices.")


BiasValue = Annotated[float, Field(ge=-100, le=100)]


class CompletionRequest(OpenAIStructured):
    """`POST /v1/completions`."""

    model: str | None = Field(None, description="The served model's id (/v1/models), or unset; any other is 404.")
    prompt: PromptInput = Field(
        description="A prompt or a list of prompts, each a text or a list of token ids (ids in the tokenizer's "
        "vocabulary, `/tokenizer_info`'s vocab_size).")
    suffix: str | None = Field(None, description="Refused when set: this model does not insert text.")
    max_tokens: int | None = Field(
        None, ge=0, description="Tokens to generate at most (16 when unset, as OpenAI; capped by the server). "
        "0 only with echo: the prompt is scored (its prefill) and nothing is generated.")
    temperature: float = Field(1.0, ge=0, le=2, description="0 picks the most likely token; > 0 samples.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens (0 or -1: all).")
    repetition_penalty: float = Field(1.0, gt=0, le=100, description="Penalty on repeated tokens (1: none).")
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="Subtracted from a token's logit per time it was generated before.")
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="Subtracted from a token's logit once it has been generated.")
    logit_bias: dict[str, BiasValue] | None = Field(
        None, description="Token id (as a string) -> value in [-100, 100] added to its logit.")
    n: int = Field(1, ge=1, description="Choices per prompt (at most /info's max_best_of); each samples with "
                   "its own seed, derived from `seed`.")
    best_of: int | None = Field(
        None, ge=1, description="Generate this many per prompt (>= n, at most max_best_of) and return the n of "
        "the highest summed logprob. Not when streaming.")
    stream: bool = Field(False, description="Stream Server-Sent Events ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="With stream: `include_usage`.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return each token's logprob and its N most likely "
        "alternatives (with the chosen token's: up to N+1).")
    echo: bool = Field(False, description="Prepend the prompt to the text; with logprobs, score its tokens too "
                       "(the first has none), in the prefill's one forward pass.")
    stop: str | list[str] | None = Field(None, description="Stop sequences (not included in the text).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Random seed: same seed, same tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-text token.")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="Keep only the last N prompt tokens.")
    cache_prefix_chars: int | None = Field(None, ge=1, description=CACHE_PREFIX_DESCRIPTION + " Text prompts only.")
    cache_salt: str | None = cache_salt_field()
    user: str | None = Field(None, description="The end user's id, written into the request's log line.")

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty strings")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("suffix (insertion) is not supported by this model")
        return value

    # a token-id prompt's cached head, in tokens: set by /v1/chat/completions for cache_prefix_messages (whose
    # prompt is ids: the template's control tokens and the messages' text), never by a client
    _cached_tokens: int | None = PrivateAttr(default=None)

    @property
    def cached_tokens(self) -> int | None:
        return self._cached_tokens

    @cached_tokens.setter
    def cached_tokens(self, value: int | None) -> None:
        self._cached_tokens = value

    def prompts(self, tokenizer: PromptTokenizer) -> list[str]:
        """Each prompt's text (token ids decoded), as echo shows it."""
        return [prompt_text(item, tokenizer) for item in prompt_items(self.prompt)]

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 (with echo): the prompt is scored and the one token its prefill picks is dropped."""
        return self.max_tokens == 0

    def sequences(self, limits: Limits) -> int:
        """How many to generate per prompt (best_of, else n), checked against n, streaming and the limits."""
        best_of = self.best_of if self.best_of is not None else self.n
        for name, value in (("n", self.n), ("best_of", best_of)):
            if value > limits.max_best_of:
                raise ValidationFailed(f"{name} must be <= {limits.max_best_of} (got {value})", param=name)
        if best_of < self.n:
            raise ValidationFailed(f"best_of must be >= n (got best_of={best_of}, n={self.n})", param="best_of")
        if self.stream and best_of > self.n:
            raise ValidationFailed("best_of > n is not supported when streaming", param="best_of")
        if self.stream and self.n > 1:
            raise ValidationFailed("stream supports n=1", param="n")
        if self.stream_options is not None and not self.stream:
            raise ValidationFailed("stream_options needs stream true", param="stream_options")
        if self.max_tokens == 0 and not self.echo:
            raise ValidationFailed("max_tokens 0 needs echo true (it scores the prompt)", param="max_tokens")
        return best_of

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, value) pairs; a key that is not a token id of this vocabulary is refused."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            token_id = token_id_key(key, vocab_size)
            if token_id is None:
                raise ValidationFailed(
                    f"logit_bias keys must be token ids in [0, {vocab_size}) (got {key[:40]!r})", param="logit_bias")
            pairs.append((token_id, float(value)))
        return tuple(sorted(pairs))

    def to_specs(self, tokenizer: PromptTokenizer, limits: Limits) -> list[list[GenerationSpec]]:
        """Per prompt, one spec per sequence to generate (`sequences`), each with its own seed."""
        prompts = prompt_items(self.prompt)
        check_batch_size(len(prompts), limits, "prompt")
        count = self.sequences(limits)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens > limits.max_input_tokens:
            raise ValidationFailed(
                f"truncate_prompt_tokens must be <= {limits.max_input_tokens} (got {self.truncate_prompt_tokens})",
                param="truncate_prompt_tokens",
            )
        # An unset max_tokens must not be refused by a server whose limit is under OpenAI's default; 0 (scoring)
        # runs the prefill, whose one token is dropped
        max_new = (min(OPENAI_DEFAULT_MAX_TOKENS, limits.max_new_tokens) if self.max_tokens is None
                   else max(check_new_tokens(self.max_tokens, limits, "max_tokens"), 1))
        stop = check_stop(self.stop_list(), limits, "stop")
        bias = self.bias(tokenizer.vocab_size)
        seeds = choice_seeds(self.seed, count)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        specs = []
        if self.cache_prefix_chars is not None and (self.truncate_prompt_tokens is not None or prompt_logprobs
                                                    is not None or any(not isinstance(p, str) for p in prompts)):
            raise ValidationFailed("cache_prefix_chars needs text prompts, and cannot be combined with "
                                   "truncate_prompt_tokens or echo with logprobs", param="cache_prefix_chars")
        for item, field in zip(prompts, item_fields("prompt", self.prompt), strict=True):
            cut = None
            if self.cache_prefix_chars is not None:
                assert isinstance(item, str)
                ids, cut = split_encode(tokenizer, item, self.cache_prefix_chars, limits,  # type: ignore[arg-type]
                                        field=field, param="cache_prefix_chars")
            else:
                ids = prompt_ids(item, tokenizer, limits, field=field, keep_last=self.truncate_prompt_tokens,
                                 truncate_hint="set truncate_prompt_tokens to keep the last")
                cut = self.cached_tokens
            new_tokens = fit_new_tokens(len(ids), max_new, limits, explicit=self.max_tokens is not None,
                                        input_field=field, new_field="max_tokens")
            specs.append([GenerationSpec(ids, self.sampling(seed, bias), new_tokens, stop,
                                         stop_on_eos=not self.ignore_eos, prompt_logprobs=prompt_logprobs,
                                         cache_prefix_tokens=cut, constraint=self.compiled_constraint)
                          for seed in seeds])
        return specs

    def sampling(self, seed: int | None, bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature if self.temperature > 0 else 1.0,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            do_sample=self.temperature > 0,
            seed=seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=bias,
            top_logprobs=self.logprobs or 0,
        )


def token_id_key(key: str, vocab_size: int) -> int | None:
    """A JSON object key that spells a token id of the vocabulary in ASCII digits, as that id; else None.
    The length is checked before int(): Python refuses to convert more than 4300 digits (ValueError), and
    `isdigit` also holds for digits int() does not take (superscripts) or takes as other scripts' numerals."""
    digits = key.lstrip("0") or "0"
    if not (key.isascii() and key.isdigit()) or len(digits) > len(str(vocab_size)):
        return None
    token_id = int(digits)
    return token_id if token_id < vocab_size else None


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    # OpenAI's: of prompt_tokens, those not prefilled (restored from the prefix cache, or shared with an identical
    # prompt); on generation routes only
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # which seed each choice sampled with (choice index order), to reproduce one alone with n=1
    seeds: list[int | None] | None = None


class EmbeddingsRequest(RequestModel):
    """`POST /v1/embeddings`."""

    input: InputText | list[InputText] = Field(description="A text or a list of texts.")
    model: str | None = Field(None, description="The served model's id (/v1/models), or unset; any other is 404.")
    encoding_format: Literal["float", "base64"] = Field("float", description="Floats, or base64 little-endian f32.")
    dimensions: int | None = Field(None, ge=1, description="Must be unset or equal to the model's dimension.")
    user: str | None = Field(None, description="The end user's id, written into the request's log line.")

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
