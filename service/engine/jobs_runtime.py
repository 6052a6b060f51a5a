"""The engine's per-request state: admission state, delivery to the event loop (one hand-off per loop for a
whole decode step), for generations the sampling, detokenization and stop checks done after each model
step, and `GenerationStream`, the handler's side of a generation."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Callable
from typing import Any

from model.sampling import Sampler
from service.errors import ServiceError
from service.jobs import (
    EmbeddingResult,
    EmbeddingSpec,
    FinishEvent,
    FinishReason,
    GenerationSpec,
    PromptLogprobs,
    Timings,
    TokenEvent,
)
from service.observability.logs import request_id_var
from service.text.detokenize import TextStream
from service.text.structured import SequenceConstraint

log = logging.getLogger("service.engine")

_sequence = itertools.count()


class JobState(enum.Enum):
    PENDING = "pending"  # admitted, waiting in the queue
    RUNNING = "running"  # the model has started on it
    DONE = "done"  # finished, failed, timed out or dropped


class Job:
    """Common part of a queued request. State changes happen under the engine's lock."""

    kind: str = ""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str | None):
        self.loop = loop
        # made on the event loop, in the request's context: its id, for the worker thread's log lines
        self.request_id = request_id or request_id_var.get()
        self.seq = next(_sequence)
        self.state = JobState.PENDING
        self.timings = Timings()
        self.cancel_requested = False
        self.timer: asyncio.TimerHandle | None = None

    def call_in_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the request's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def fail(self, error: ServiceError) -> None:
        raise NotImplementedError


class EmbedJob(Job):
    kind = "embed"

    def __init__(self, spec: EmbeddingSpec, loop: asyncio.AbstractEventLoop, request_id: str | None):
        super().__init__(loop, request_id)
        self.spec = spec
        self.vectors: list[list[float] | None] = [None] * len(spec.sequences)
        self.items_left = len(spec.sequences)
        self.future: asyncio.Future[EmbeddingResult] = loop.create_future()

    def _resolve(self, result: EmbeddingResult | None, error: ServiceError | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)  # type: ignore[arg-type]

    def complete(self) -> None:
        vectors = [v for v in self.vectors if v is not None]
        result = EmbeddingResult(vectors=vectors, prompt_tokens=self.spec.total_tokens, timings=self.timings)
        self.call_in_loop(self._resolve, result, None)

    def fail(self, error: ServiceError) -> None:
        self.call_in_loop(self._resolve, None, error)


Event = TokenEvent | ServiceError


class GenerationJob(Job):
    """A generation: after each model step, `accept` samples the next token and decides whether to stop."""

    kind = "generate"

    def __init__(
        self, spec: GenerationSpec, loop: asyncio.AbstractEventLoop, request_id: str | None, tokenizer: Any,
        stream: bool = True,
    ):
        super().__init__(loop, request_id)
        self.spec = spec
        self.timings.prefill.tokens = len(spec.prompt_ids)
        # False: token events are held until the last one and delivered together (a non-streaming caller
        # wakes once, not once per token, so the event loop does not contend for the GIL at every step)
        self.stream = stream
        self.held: list[TokenEvent] = []
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_id
        self.is_special: Callable[[int], bool] = tokenizer.is_special
        self.sampler: Sampler | None = None
        self.cache: Any = None  # the model's DecodeState while running
        self.history: list[int] = list(spec.prompt_ids)
        # the prompt's segment, prefilled in one forward (or restored from the prefix cache), and the tokens after
        # it, fed as decode steps before the first token is sampled (service/engine/prompt_reuse.py)
        cut = len(spec.prompt_ids) if spec.cache_prefix_tokens is None else spec.cache_prefix_tokens
        self.prefill_ids: list[int] = list(spec.prompt_ids[:cut])
        self.suffix: list[int] = list(spec.prompt_ids[cut:])
        self.fed = 0  # suffix tokens fed so far (the pending one included)
        self.prefix_key: str | None = None  # the segment's key in the prefix cache
        self.reuse_key: str | None = None  # the same key, worked out once (service/engine/prompt_reuse.py `_key`)
        # a causal prompt's block tails (model/decoding/prefix_restore.py BlockTails) until its state is kept,
        # and its key chain, (length, key) after every block (service/engine/prompt_reuse.py), hashed once
        self.tails: Any = None
        self.links: list[tuple[int, str]] | None = None
        # the disk tier's read of the segment's state, done off the worker's thread before the job starts
        # (Engine.generate): pending while it runs (the job waits in the queue), then the state or None
        self.read_ahead_pending = False
        self.read_ahead: Any = None  # a StateSnapshot read from the disk tier
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.pending_token: int | None = None  # sampled, not yet fed to the model
        self.last_token_at: float | None = None
        self.decoder: TextStream | None = None
        # the prompt's scores from its prefill (model/decoding/prefill/scores.py PromptScores), when the spec
        # asked: the first token's event carries them
        self.prompt_scores: Any = None
        # structured output: the sequence's matcher, advanced by each token it takes (its mask is applied to
        # the logits before `accept`: service/engine/constrained.py)
        self.constraint: SequenceConstraint | None = None

    def begin(self) -> None:
        self.sampler = Sampler(self.spec.sampling)
        if self.spec.constraint is not None:
            self.constraint = SequenceConstraint(self.spec.constraint)
        self.decoder = TextStream(self.tokenizer, self.spec.stop_sequences, at_end=self.spec.stop_at_end)

    @property
    def seed(self) -> int | None:
        return getattr(self.sampler, "seed", None)

    def accept(self, logits: Any, greedy: tuple[int, float] | None = None) -> TokenEvent:
        """Sample from the next-token logits (a plain-greedy request takes `greedy`, the batch's choice for its
        row, when given); the event carries `finish` if this token ends the generation."""
        assert self.sampler is not None and self.decoder is not None
        top: tuple[tuple[int, float], ...] = ()
        if greedy is not None and self.sampler.plain_greedy:
            token, logprob = greedy
        else:
            choice = self.sampler.choose(logits, self.history, self.generated)
            token, logprob, top = choice.token, choice.logprob, choice.top
        token = int(token)
        if self.constraint is not None:
            self.constraint.consume(token)
        self.generated.append(token)
        self.history.append(token)
        special = self.is_special(token)
        text = self.decoder.push(token)
        reason: FinishReason | None = None
        if self.spec.stop_on_eos and token == self.eos_id:
            reason = "eos_token"
        elif self.constraint is not None and self.constraint.finished:
            reason = "eos_token"  # the structure is complete: nothing more may follow it
        elif len(self.generated) >= self.spec.max_new_tokens:
            reason = "length"
        if reason is not None:
            text += self.decoder.flush()
        # the last token's text is checked too: a stop sequence in it ends the text there (OpenAI cuts it),
        # as vLLM checks stop strings before max_tokens; the end-of-text token adds no text of its own
        if reason != "eos_token" and self.decoder.stopped(text):
            if reason is None:
                text += self.decoder.flush()
            reason = "stop_sequence"
        self.text_parts.append(text)
        self.pending_token = token
        finish = None
        if reason is not None:
            finish = FinishEvent(
                finish_reason=reason,
                generated_ids=list(self.generated),
                generated_text="".join(self.text_parts),
                prompt_tokens=len(self.spec.prompt_ids),
                seed=self.seed,
                cached_tokens=self.timings.cached_tokens,
            )
        scored, self.prompt_scores = self.prompt_scores, None
        return TokenEvent(len(self.generated) - 1, token, text, float(logprob), special, finish, top,
                          prompt_logprobs(scored) if scored is not None else None)

    def to_deliver(self, event: TokenEvent) -> list[TokenEvent]:
        """The events to hand to the loop now that `event` is produced: itself when streaming, else nothing
        until the last token, then every token in order."""
        if self.stream:
            return [event]
        self.held.append(event)
        if event.finish is None:
            return []
        held, self.held = self.held, []
        return held

    def deliver(self, event: Event) -> None:
        self.call_in_loop(self.events.put_nowait, event)

    def fail(self, error: ServiceError) -> None:
        self.deliver(error)

    def release(self) -> None:
        """Free the decode cache (the request ended, failed or was dropped)."""
        self.cache = None
        self.decoder = None
        self.constraint = None

    @property
    def feeding(self) -> bool:
        """Whether the model still has prompt tokens to read before this job samples."""
        return self.fed < len(self.suffix)

    def feed_next(self) -> None:
        """The next prompt token after the segment is the token the next decode step reads."""
        self.pending_token = self.suffix[self.fed]
        self.fed += 1


def prompt_logprobs(scores: Any) -> PromptLogprobs:
    """A prefill's PromptScores as the event carries them (host values, alternatives paired with their ids)."""
    top = tuple(tuple(zip(ids, values, strict=True))
                for ids, values in zip(scores.top_ids.tolist(), scores.top_logprobs.tolist(), strict=True))
    return PromptLogprobs(tuple(scores.logprobs.tolist()), top)


def deliver_together(deliveries: list[tuple[GenerationJob, Event]]) -> None:
    """Deliver many requests' events with one hand-off per event loop: a decode step wakes the loop once, not
    once per running request (each wake-up is a write to the loop's self-pipe and a contest for the GIL
    with the worker thread). Each request still receives its events in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
    for job, event in deliveries:
        by_loop.setdefault(job.loop, []).append((job.events, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class GenerationStream:
    """The handler's view of a generation: await events, cancel when the client goes away."""

    def __init__(self, job: GenerationJob, cancel: Callable[[Job], None]):
        self.job = job
        self._cancel = cancel  # the engine's: drops the job wherever it is (queue or running)

    @property
    def timings(self) -> Any:
        return self.job.timings

    async def next_event(self) -> TokenEvent:
        try:
            event = await self.job.events.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(event, ServiceError):
            raise event
        return event

    def cancel(self) -> None:
        self._cancel(self.job)
