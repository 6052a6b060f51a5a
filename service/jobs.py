"""What the HTTP layer hands the engine (specs) and what it gets back (events, results, timings)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from model.sampling import SamplingParams

Pooling = Literal["mean", "last"]
FinishReason = Literal["length", "eos_token", "stop_sequence"]


class OutputConstraint(Protocol):
    """A compiled structured-output constraint (service/text/structured/grammars.py CompiledGrammar): what a
    generation's tokens must spell. `kind`: json_schema, json_object, regex, choice or grammar; `key`: its
    source's content, what the compile cache keys it by."""

    @property
    def kind(self) -> str: ...

    @property
    def key(self) -> str: ...


@dataclass(frozen=True)
class GenerationSpec:
    """One generation, already validated and tokenized."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    stop_on_eos: bool = True
    # where a stop sequence must be: True (TGI) at the end of the text so far; False (OpenAI, vLLM) anywhere in
    # the text the newest token added (the route cuts the text there)
    stop_at_end: bool = False
    # score the prompt too: None no; k >= 0 each prompt token's logprob and its k most likely alternatives,
    # from the prefill's forward (TokenEvent.prompt_logprobs)
    prompt_logprobs: int | None = None
    # the prompt's first N tokens are its segment: prefilled in one forward and kept in the prefix cache, the
    # rest fed as decode steps (service/engine/prompt_reuse.py); None: the whole prompt is the segment
    cache_prefix_tokens: int | None = None
    # the tenant's cache salt (service/api/protocol/cache_salt.py): it starts the prefix key's chain, so prompts
    # under different salts never share a kept state, an in-flight prefill or a cached_tokens report
    cache_salt: str | None = None
    # structured output: only tokens the constraint allows are sampled, and the generation ends (as at end of
    # text) once the constraint is complete and allows nothing more; None: unconstrained
    constraint: OutputConstraint | None = None


@dataclass(frozen=True)
class EmbeddingSpec:
    """One embedding request: one or more tokenized sequences pooled the same way."""

    sequences: list[list[int]]
    pooling: Pooling = "mean"
    normalize: bool = True

    @property
    def total_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


# The prefill slices a job keeps one by one (its trace shows them as events of the `prefill` span): the
# first ones; the rest are only counted and summed, so a 500K-token prompt's ~11,000 slices cost no more.
PREFILL_SLICES_KEPT = 32


@dataclass
class PrefillTimings:
    """A job's prefill summed over its calls (one, or one per slice of a long prompt prefilled between decode
    steps): its trace's one `prefill` span and that span's attributes (service/observability/tracing.py). Its
    size does not grow with the prompt."""

    tokens: int = 0  # the prompt's tokens (of which Timings.cached_tokens were not prefilled)
    slices: int = 0
    began: float | None = None  # the first slice's start
    ended: float | None = None  # the last slice's end
    total_s: float = 0.0  # the slices' summed time (without the decode steps between them)
    longest_s: float = 0.0
    first_slices: list[tuple[float, float]] = field(default_factory=list)  # (start, end), PREFILL_SLICES_KEPT

    def add_slice(self, began: float, ended: float) -> None:
        """One prefill call (or slice) the job's prompt took part in, from `began` to `ended` (monotonic)."""
        took = max(0.0, ended - began)
        self.slices += 1
        self.began = began if self.began is None else self.began
        self.ended = ended
        self.total_s += took
        self.longest_s = max(self.longest_s, took)
        if len(self.first_slices) < PREFILL_SLICES_KEPT:
            self.first_slices.append((began, ended))


@dataclass
class Timings:
    """Monotonic timestamps of a job's life; the durations feed headers and histograms, and the request's
    trace is made of them (service/observability/tracing.py)."""

    enqueued: float = field(default_factory=time.monotonic)
    admitted: float | None = None  # past the admission checks, in the queue
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prefill: PrefillTimings = field(default_factory=PrefillTimings)
    # prompt tokens restored from the prefix cache, or copied from an identical prompt prefilled with it,
    # instead of prefilled (service/engine/prompt_reuse.py); the prefill span's `reformer.prefill.cached_tokens`
    cached_tokens: int = 0
    # structured output: the mask time of the batches this job was constrained in (each batch's whole time,
    # computed alongside the model's step) and their count; the decode span's `reformer.structured.*`
    mask_s: float = 0.0
    mask_steps: int = 0

    @property
    def queue_s(self) -> float:
        return (self.started or self.finished or time.monotonic()) - self.enqueued

    @property
    def inference_s(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.monotonic()) - self.started


Alternatives = tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt scored by its prefill (the one-piece forward, or the causal prefill's extend with every token's
    logits): entry i is prompt token i+1's log-probability given the tokens before it, and the most likely
    tokens at that position (as many as the spec asked)."""

    logprobs: tuple[float, ...]
    top: tuple[Alternatives, ...]


@dataclass(frozen=True)
class FinishEvent:
    """The end of a generation."""

    finish_reason: FinishReason
    generated_ids: list[int]
    generated_text: str
    prompt_tokens: int
    seed: int | None
    cached_tokens: int = 0  # of prompt_tokens, how many were not prefilled (Timings.cached_tokens)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `text` is what it completes (empty inside a multi-byte character).
    The last token of a generation carries `finish`."""

    index: int
    id: int
    text: str
    logprob: float
    special: bool
    finish: FinishEvent | None = None
    # the most likely alternatives (id, log-probability), most likely first, when the spec's sampling asks
    top: Alternatives = ()
    # on a generation's first token, when the spec asked: its prompt scored by the prefill
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int
    timings: Timings
