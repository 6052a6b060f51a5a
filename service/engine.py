"""The model executor: ONE worker thread owns the model and the device; handlers only enqueue and await.

Each turn of the worker loop: admit queued generations (prefill, up to `max_batch_tokens` prompt tokens and
`max_batch_size` running), run one decode step for every running generation together (continuous batching:
requests join and leave between steps), then run one embedding batch if one is ready (full, or its oldest
request waited `max_wait_ms`). Embedding batches group requests of similar length under a padded-token
budget. The queue is bounded (429 beyond it); a request still queued after `request_timeout_s` gets 504;
a request whose client went away is dropped from the queue or from the running batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from service.backends import EmbeddingBackend
from service.errors import InternalError, Overloaded, QueueTimeout, ServiceError, Unavailable
from service.jobs import EmbeddingResult, EmbeddingSpec, GenerationSpec, TokenEvent
from service.jobs_runtime import EmbedJob, GenerationJob, Job, JobState
from service.metrics import ServiceMetrics

log = logging.getLogger("service.engine")


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_wait_ms: float = 5.0
    max_queue_size: int = 64
    request_timeout_s: float = 60.0
    warmup: bool = True


class Reservation:
    """A place in the queue held by a request between its arrival and its admission (see Engine.reserve)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = True


# The reservation of the request being handled (set by the availability middleware, read by `_admit`).
current_reservation: contextvars.ContextVar[Reservation | None] = contextvars.ContextVar(
    "current_reservation", default=None
)


@dataclass
class _EmbedItem:
    job: EmbedJob
    index: int
    ids: list[int]


class GenerationStream:
    """The handler's view of a generation: await events, cancel when the client goes away."""

    def __init__(self, engine: Engine, job: GenerationJob):
        self.engine = engine
        self.job = job

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
        self.engine.cancel(self.job)


class Engine:
    def __init__(
        self, model: Any, tokenizer: Any, backend: EmbeddingBackend, device: torch.device, config: EngineConfig,
        metrics: ServiceMetrics, on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.backend = backend
        self.device = device
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self._cond = threading.Condition()
        self._gen_queue: deque[GenerationJob] = deque()
        self._embed_items: list[_EmbedItem] = []
        self._pending = {"embed": 0, "generate": 0}
        self._reserved = 0  # requests arrived but not yet admitted (touched on the event loop only)
        self._running: list[GenerationJob] = []
        self._cache_bytes = 0
        self._stopping = False
        self._dead = False
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reformer-model-worker", daemon=True)

    # ---- event-loop side -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queued": dict(self._pending),
                "running": len(self._running),
                "cache_bytes": self._cache_bytes,
                "alive": int(self.alive),
            }

    async def embed(self, spec: EmbeddingSpec, request_id: str | None = None) -> EmbeddingResult:
        job = EmbedJob(spec, asyncio.get_running_loop(), request_id)
        items = [_EmbedItem(job, i, ids) for i, ids in enumerate(spec.sequences)]
        self._admit(job, lambda: self._embed_items.extend(items))
        try:
            return await job.future
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    def generate(self, spec: GenerationSpec, request_id: str | None = None) -> GenerationStream:
        job = GenerationJob(spec, asyncio.get_running_loop(), request_id, self.tokenizer)
        self._admit(job, lambda: self._gen_queue.append(job))
        return GenerationStream(self, job)

    def reserve(self) -> Reservation | Overloaded:
        """A place in the queue for a request that has just arrived, or the 429 it gets at once (event loop
        only). The excess of a burst is refused before anything of it is read or parsed, while the requests
        ahead of it are still being parsed: they hold reservations until `_admit` turns them into queue
        entries, so the queue's capacity counts them from the moment they arrive."""
        if self._waiting() >= self.config.max_queue_size:
            return self._overloaded()
        self._reserved += 1
        return Reservation()

    def release(self, reservation: Reservation) -> None:
        """The request was admitted, refused or answered: its reservation no longer holds a place."""
        if reservation.held:
            reservation.held = False
            self._reserved -= 1

    def _waiting(self) -> int:
        return sum(self._pending.values()) + self._reserved

    def _overloaded(self) -> Overloaded:
        self.metrics.rejected.labels("queue_full").inc()
        waiting = self._waiting()
        return Overloaded(
            f"the queue is full ({waiting} requests waiting, max_queue_size={self.config.max_queue_size});"
            " retry later",
            headers={"Retry-After": "1"},
        )

    def _admit(self, job: Job, enqueue: Callable[[], None]) -> None:
        reservation = current_reservation.get()
        own = 1 if reservation is not None and reservation.held else 0
        with self._cond:
            if self._dead or self._stopping:
                raise Unavailable("the model worker is not running")
            if self._waiting() - own >= self.config.max_queue_size:
                raise self._overloaded()
            enqueue()
            self._pending[job.kind] += 1
            self._cond.notify()
        if reservation is not None:
            self.release(reservation)  # the place it held is now the job's
        job.timer = job.loop.call_later(self.config.request_timeout_s, self._expire, job)

    def _expire(self, job: Job) -> None:
        with self._cond:
            if job.state is not JobState.PENDING:
                return
            self._finish_pending(job)
        self.metrics.rejected.labels("timeout").inc()
        job.fail(QueueTimeout(
            f"the request waited {self.config.request_timeout_s:g} s in the queue (request_timeout_s) and was dropped"
        ))

    def cancel(self, job: Job) -> None:
        """The client went away: drop queued work now, running work at the worker's next step."""
        with self._cond:
            if job.state is JobState.PENDING:
                self._finish_pending(job)
                self.metrics.dropped.labels("queued").inc()
            elif job.state is JobState.RUNNING and isinstance(job, EmbedJob):
                # The batch in flight finishes and is discarded; the job's other inputs leave the queue.
                job.state = JobState.DONE
                self.metrics.dropped.labels("running").inc()
            elif job.state is JobState.RUNNING:
                job.cancel_requested = True
                self._cond.notify()

    def _finish_pending(self, job: Job) -> None:
        """Under the lock: a pending job leaves the queue without running."""
        job.state = JobState.DONE
        self._pending[job.kind] -= 1
        if job.timer is not None:
            job.timer.cancel()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- worker thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.config.warmup:
                self._warm_up()
            self.ready.set()
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    self._drop_cancelled()
                    prefills = self._take_prefills()
                    batch, wake_at = self._take_embed_batch()
                    if not prefills and not self._running and batch is None:
                        timeout = None if wake_at is None else max(wake_at - time.monotonic(), 0.0)
                        self._cond.wait(timeout)
                        continue
                for job in prefills:
                    self._prefill(job)
                if self._running:
                    self._decode_step()
                if batch is not None:
                    self._run_embed_batch(batch)
                self._cache_bytes = sum(job.cache.nbytes() for job in self._running if job.cache is not None)
        except BaseException as exc:  # the worker must never die silently
            self._die(exc)
            return
        self._fail_everything(Unavailable("the server is shutting down"))

    def _die(self, exc: BaseException) -> None:
        log.critical("the model worker died; the process must be restarted", exc_info=exc)
        with self._cond:
            self._dead = True
        self._fail_everything(InternalError("the model worker stopped"))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _fail_everything(self, error: ServiceError) -> None:
        with self._cond:
            jobs: list[Job] = [*self._gen_queue, *(item.job for item in self._embed_items), *self._running]
            self._gen_queue.clear()
            self._embed_items.clear()
            self._running.clear()
            self._pending = {"embed": 0, "generate": 0}
            self._cache_bytes = 0
            for job in jobs:
                job.state = JobState.DONE
        for job in {id(j): j for j in jobs}.values():
            job.fail(error)

    def _warm_up(self) -> None:
        ids = self.tokenizer.encode("warm up the model")
        mask = torch.ones(1, len(ids), dtype=torch.long)
        for pooling in ("mean", "last"):
            self.backend.embed(torch.tensor([ids]), mask, pooling)
        with torch.inference_mode():
            logits, state = self.model.prefill(torch.tensor(ids, device=self.device))
            self.model.decode_step(torch.tensor([int(logits.argmax())], device=self.device), [state])
        log.info("warm-up done")

    def _drop_cancelled(self) -> None:
        """Under the lock: forget dead queue entries, drop running work whose client went away."""
        if any(job.state is not JobState.PENDING for job in self._gen_queue):
            self._gen_queue = deque(j for j in self._gen_queue if j.state is JobState.PENDING)
        self._embed_items = [it for it in self._embed_items if it.job.state is not JobState.DONE]
        for job in [j for j in self._running if j.cancel_requested]:
            self._running.remove(job)
            job.state = JobState.DONE
            job.release()
            self.metrics.dropped.labels("running").inc()
            log.info("dropped a running generation: its client went away", extra={"request_id": job.request_id})
        if not self._running:
            self._cache_bytes = 0

    def _start(self, job: Job) -> None:
        """Under the lock: the model starts on a pending job."""
        if job.state is JobState.PENDING:
            self._pending[job.kind] -= 1
            job.state = JobState.RUNNING
            job.timings.started = time.monotonic()
            if job.timer is not None:
                job.loop.call_soon_threadsafe(job.timer.cancel)

    def _take_prefills(self) -> list[GenerationJob]:
        taken: list[GenerationJob] = []
        tokens = 0
        while self._gen_queue and len(self._running) + len(taken) < self.config.max_batch_size:
            job = self._gen_queue[0]
            if taken and tokens + len(job.spec.prompt_ids) > self.config.max_batch_tokens:
                break
            self._gen_queue.popleft()
            self._start(job)
            taken.append(job)
            tokens += len(job.spec.prompt_ids)
        return taken

    def _take_embed_batch(self) -> tuple[list[_EmbedItem] | None, float | None]:
        """Under the lock: the next embedding batch, or (None, when to look again) while it waits for company."""
        if not self._embed_items:
            return None, None
        anchor = self._embed_items[0]  # the oldest: FIFO fairness
        same_pooling = [it for it in self._embed_items if it.job.spec.pooling == anchor.job.spec.pooling]
        # Nearest lengths first, to limit padding.
        candidates = sorted(same_pooling, key=lambda it: (abs(len(it.ids) - len(anchor.ids)), it.job.seq, it.index))
        batch: list[_EmbedItem] = []
        longest = 0
        full = False
        for item in candidates:
            new_longest = max(longest, len(item.ids))
            if batch and (
                len(batch) + 1 > self.config.max_batch_size
                or new_longest * (len(batch) + 1) > self.config.max_batch_tokens
            ):
                full = True
                break
            batch.append(item)
            longest = new_longest
        full = full or len(batch) >= self.config.max_batch_size
        ready_at = anchor.job.timings.enqueued + self.config.max_wait_ms / 1000.0
        if not full and time.monotonic() < ready_at and not self._stopping:
            return None, ready_at
        chosen = {id(it) for it in batch}
        self._embed_items = [it for it in self._embed_items if id(it) not in chosen]
        for item in batch:
            self._start(item.job)
        return batch, None

    def _run_embed_batch(self, batch: list[_EmbedItem]) -> None:
        longest = max(len(it.ids) for it in batch)
        ids = torch.full((len(batch), longest), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, item in enumerate(batch):
            ids[row, : len(item.ids)] = torch.tensor(item.ids)
            mask[row, : len(item.ids)] = 1
        self.metrics.batch_size.labels("embed").observe(len(batch))
        self.metrics.batch_tokens.labels("embed").observe(longest * len(batch))
        try:
            vectors = self.backend.embed(ids, mask, batch[0].job.spec.pooling)
        except Exception:
            log.exception("embedding batch of %d failed", len(batch))
            self._fail_jobs({id(it.job): it.job for it in batch}.values())
            return
        for item, vector in zip(batch, vectors, strict=True):
            job = item.job
            if job.state is not JobState.RUNNING:
                continue
            if job.spec.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            job.vectors[item.index] = vector.tolist()
            job.items_left -= 1
            if job.items_left == 0:
                self.metrics.prompt_tokens.inc(job.spec.total_tokens)
                with self._cond:
                    job.state = JobState.DONE
                job.timings.finished = time.monotonic()
                job.complete()

    def _fail_jobs(self, jobs: Any) -> None:
        with self._cond:
            for job in jobs:
                job.state = JobState.DONE
                if isinstance(job, GenerationJob):
                    job.release()
                    if job in self._running:
                        self._running.remove(job)
        for job in jobs:
            job.fail(InternalError("internal error; the server log has the details"))

    def _prefill(self, job: GenerationJob) -> None:
        try:
            job.begin()
            with torch.inference_mode():
                logits, job.cache = self.model.prefill(torch.tensor(job.spec.prompt_ids, device=self.device))
            self.metrics.batch_size.labels("prefill").observe(1)
            self.metrics.batch_tokens.labels("prefill").observe(len(job.spec.prompt_ids))
            self.metrics.prompt_tokens.inc(len(job.spec.prompt_ids))
            with self._cond:
                self._running.append(job)
            self._advance(job, logits)
        except Exception:
            log.exception("prefill failed", extra={"request_id": job.request_id})
            self._fail_jobs([job])

    def _decode_step(self) -> None:
        jobs = list(self._running)
        try:
            tokens = torch.tensor([job.pending_token for job in jobs], device=self.device)
            with torch.inference_mode():
                logits = self.model.decode_step(tokens, [job.cache for job in jobs])
            self.metrics.batch_size.labels("decode").observe(len(jobs))
            self.metrics.batch_tokens.labels("decode").observe(len(jobs))
            for job, row in zip(jobs, logits, strict=True):
                self._advance(job, row)
        except Exception:
            log.exception("decode step over %d generations failed", len(jobs))
            self._fail_jobs(jobs)

    def _advance(self, job: GenerationJob, logits: torch.Tensor) -> None:
        """Sample the job's next token, deliver it, and retire the job if it is finished."""
        event = job.accept(logits.float().cpu())
        now = time.monotonic()
        if job.last_token_at is None:
            job.timings.first_token = now
            self.metrics.ttft.observe(now - job.timings.enqueued)
        else:
            self.metrics.itl.observe(now - job.last_token_at)
        job.last_token_at = now
        self.metrics.generated_tokens.inc()
        if event.finish is not None:
            job.timings.finished = now
            with self._cond:
                job.state = JobState.DONE
                if job in self._running:
                    self._running.remove(job)
            job.release()
        job.deliver(event)
