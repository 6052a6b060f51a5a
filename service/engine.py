"""The model executor: ONE worker thread owns the model and the device; handlers only enqueue and await.

The engine in parts: `service/admission.py` (queue bound, reservations, queue timeouts), `service/policy.py`
(pure functions: which generations start, how prompts are grouped, which embedding batch runs),
`service/runner.py` (the model runner: device tensors, the decode cache, batched prefill and decode steps),
`service/embed_batches.py` (the queued inputs of embedding requests and their batches),
`service/jobs_runtime.py` (per-request state and delivery to the event loop) and, here, the worker loop that
ties them together with the generations' prefills and decode steps. Each turn: start the queued
generations the policy and the decode cache allow (prefilled together, grouped by length under
`max_batch_tokens`, or sliced between decode steps when long), run ONE batched decode step over every
running generation (continuous batching: requests join and leave between steps), then one embedding batch
if one is ready. A failure in one request's work fails that request only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from model.kernels.weights import WeightKind
from model.sampling import greedy_choices
from service.admission import Admission, Reservation
from service.backends import EmbeddingBackend
from service.embed_batches import EmbedBatches
from service.errors import InputTooLong, InternalError, Overloaded, ServiceError, Unavailable
from service.jobs import EmbeddingResult, EmbeddingSpec, GenerationSpec, TokenEvent
from service.jobs_runtime import EmbedJob, Event, GenerationJob, GenerationStream, Job, JobState, deliver_together
from service.memory import HeapKeeper
from service.metrics import ServiceMetrics
from service.policy import (
    SLICE_HISTORY,
    QueuedGeneration,
    another_slice_fits,
    group_by_length,
    take_generations,
)
from service.runner import ModelRunner

log = logging.getLogger("service.engine")

# A prefill group of more padded tokens than this is sliced between decode steps while generations run.
CHUNKED_PREFILL_TOKENS = 2048

# Reservation lives in service/admission.py and GenerationStream in service/jobs_runtime.py; importers of
# service.engine keep them.
__all__ = ["Engine", "EngineConfig", "GenerationStream", "Reservation"]


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_wait_ms: float = 5.0
    max_queue_size: int = 64
    request_timeout_s: float = 60.0
    warmup: bool = True
    cache_bytes: int | None = None  # decode-cache capacity; None: service/runner.py's default share
    batch_invariant: bool = False  # decode steps in fixed row blocks: bit-identical to a request alone
    max_request_tokens: int | None = None  # longest prompt plus max_new_tokens admitted; None: max positions
    cuda_graphs: bool = False  # on CUDA, decode steps replay captured graphs (model/decoding/steps/cuda_graphs.py)
    cpu_kernels: bool = True  # on CPU, decode steps attend through the C window kernel (model/kernels/bindings.py)
    kv_cache_dtype: torch.dtype | None = None  # the decode cache's keys and values; None: the model's dtype
    decode_weights: WeightKind = "float32"  # the C decode step's linear weights (model/kernels/weights.py)
    # Between two decode steps, sliced prefills run slice after slice while the next one, if it takes as long
    # as the longest of the last few (service/policy.py another_slice_fits), still ends within this much time
    # (at least one slice per step; 0: one slice per step). A running stream's gap is then about one decode
    # step plus this (model/decoding/prefill/slices.py bounds a slice), and the prefill keeps about budget / (budget +
    # decode step) of the time (bench/prefill_gap.py measures both; REFORMER_PREFILL_BUDGET_MS)
    prefill_budget_ms: float = 100.0
    idle_trim_s: float = 2.0  # idle this long: the heap's free pages go back to the system (service/memory.py)
    memory_budget_bytes: int = 0  # RSS above which the worker trims between turns too; 0: only when idle
    busy_trim_s: float = 30.0  # busy this long since the last trim: trim between turns (0: never)
    # after a request finishes, the decode cache's pool pages of free blocks beyond the lowest this many bytes go
    # back to the system (service/memory.py HeapKeeper; None: only idle or over the budget)
    cache_keep_bytes: int | None = 64 * 2**20


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
        self.admission = Admission(config.max_queue_size, config.request_timeout_s, metrics)
        self._cond = self.admission.cond
        self._gen_queue: deque[GenerationJob] = deque()
        self.embeds = EmbedBatches(backend, tokenizer.pad_id, metrics, self._cond, config.max_batch_size,
                                   config.max_batch_tokens, config.max_wait_ms / 1000.0)
        self._running: list[GenerationJob] = []
        # long prompts being prefilled slice by slice between decode steps: (jobs, their prefill in progress,
        # the durations of its last few slices)
        self._prefilling: list[tuple[list[GenerationJob], Generator[None, None, Any], deque[float]]] = []
        self.runner = ModelRunner(model, device, config.max_batch_size, config.cache_bytes, config.batch_invariant,
                                  config.max_request_tokens, config.cuda_graphs, config.cpu_kernels,
                                  config.kv_cache_dtype, config.decode_weights)
        self.memory = HeapKeeper(config.idle_trim_s, config.memory_budget_bytes,
                                 release=self.runner.release_free_pages, keep_bytes=config.cache_keep_bytes,
                                 busy_trim_s=config.busy_trim_s)
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
                **self.runner.stats(),
                "alive": int(self.alive),
            }

    async def embed(self, spec: EmbeddingSpec, request_id: str | None = None,
                    reservation: Reservation | None = None) -> EmbeddingResult:
        job = EmbedJob(spec, asyncio.get_running_loop(), request_id)
        self._admit(job, lambda: self.embeds.enqueue(job), reservation)
        try:
            return await job.future
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    def generate(self, spec: GenerationSpec, request_id: str | None = None,
                 reservation: Reservation | None = None, stream: bool = True) -> GenerationStream:
        """Queue a generation. `stream=False`: the caller only needs the finished result, so its token events
        reach the event loop all at once with the last one, not one wake-up of the loop per token."""
        tokens = len(spec.prompt_ids) + spec.max_new_tokens
        if not self.runner.fits_ever(tokens):
            # waiting would never help: the decode cache could not hold it even empty
            self.metrics.rejected.labels("cache_capacity").inc()
            raise InputTooLong(self.runner.limit_message(tokens))
        job = GenerationJob(spec, asyncio.get_running_loop(), request_id, self.tokenizer, stream)
        self._admit(job, lambda: self._gen_queue.append(job), reservation)
        return GenerationStream(job, self.cancel)

    def reserve(self) -> Reservation | Overloaded:
        return self.admission.reserve()

    def release(self, reservation: Reservation) -> None:
        self.admission.release(reservation)

    @property
    def _pending(self) -> dict[str, int]:
        return self.admission.pending

    @property
    def _reserved(self) -> int:
        return self.admission.reserved

    def _admit(self, job: Job, enqueue: Callable[[], None], reservation: Reservation | None = None) -> None:
        self.admission.admit(job, enqueue, reservation, lambda: self._dead or self._stopping)

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
        self.admission.finish_pending(job)

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
                    batch, wake_at = self.embeds.take(self._start, flush=self._stopping)
                    trim = False
                    if not prefills and not self._running and not self._prefilling and batch is None:
                        timeout = None if wake_at is None else max(wake_at - time.monotonic(), 0.0)
                        # idle with nothing queued either: once per idle spell the heap is trimmed
                        trim = self.memory.idle_turn(not self._gen_queue and not self.embeds.items)
                        if not trim:
                            self._cond.wait(self.memory.idle_wait(timeout))
                            continue
                if trim:  # outside the lock, so requests are admitted meanwhile; never raises
                    self.memory.trim("idle")
                    continue
                if prefills:
                    self._prefill_all(prefills)
                if self._prefilling:
                    self._advance_prefills()
                if self._running:
                    self._decode_step()
                if batch is not None:
                    self.embeds.run(batch, self._fail_jobs)
                self.memory.after_work()  # the idle spell restarts; over the memory budget, a trim
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
        for _, slices, _ in self._prefilling:
            slices.close()  # frees the cache it held
        with self._cond:
            jobs: list[Job] = [*self._gen_queue, *self.embeds.jobs(), *self._running,
                               *(job for group, _, _ in self._prefilling for job in group)]
            self._prefilling.clear()
            self._gen_queue.clear()
            self.embeds.clear()
            self._running.clear()
            self.admission.clear()
            for job in jobs:
                job.state = JobState.DONE
                if isinstance(job, GenerationJob):
                    self._release(job)
        for job in {id(j): j for j in jobs}.values():
            job.fail(error)

    def _release(self, job: GenerationJob) -> None:
        """The job's decode cache goes back to the allocator (its blocks and slot), then the job forgets it."""
        self.runner.free(job.cache)
        job.release()

    def _warm_up(self) -> None:
        ids = self.tokenizer.encode("warm up the model")
        mask = torch.ones(1, len(ids), dtype=torch.long)
        for pooling in ("mean", "last"):
            self.backend.embed(torch.tensor([ids]), mask, pooling)
        logits, states = self.runner.prefill([ids], [len(ids) + 1])
        try:
            self.runner.decode([int(logits[0].argmax())], states)
        finally:
            self.runner.free(states[0])
        log.info("warm-up done")

    def _drop_cancelled(self) -> None:
        """Under the lock: forget dead queue entries, drop running work whose client went away."""
        if any(job.state is not JobState.PENDING for job in self._gen_queue):
            self._gen_queue = deque(j for j in self._gen_queue if j.state is JobState.PENDING)
        self.embeds.drop_done()
        for job in [j for j in self._running if j.cancel_requested]:
            self._running.remove(job)
            job.state = JobState.DONE
            self._release(job)
            self.metrics.dropped.labels("running").inc()
            log.info("dropped a running generation: its client went away", extra={"request_id": job.request_id})

    def _start(self, job: Job) -> None:
        self.admission.start(job)

    def _take_prefills(self) -> list[GenerationJob]:
        """Under the lock: the generations that start now (service/policy.py decides)."""
        queued = [QueuedGeneration(len(j.spec.prompt_ids), len(j.spec.prompt_ids) + j.spec.max_new_tokens)
                  for j in self._gen_queue]
        n = take_generations(queued, len(self._running), self.config.max_batch_size, self.config.max_batch_tokens,
                             self.runner.fits_together)
        taken = [self._gen_queue.popleft() for _ in range(n)]
        for job in taken:
            self._start(job)
        return taken

    def _fail_jobs(self, jobs: Any) -> None:
        jobs = list(jobs)
        with self._cond:
            for job in jobs:
                job.state = JobState.DONE
                if isinstance(job, GenerationJob):
                    self._release(job)
                    if job in self._running:
                        self._running.remove(job)
        for job in jobs:
            job.fail(InternalError("internal error; the server log has the details"))

    def _prefill_all(self, jobs: list[GenerationJob]) -> None:
        """Prompts prefilled together, grouped by length under max_batch_tokens (one at a time when the
        engine runs batch-invariant, so a request's first token does not depend on its company)."""
        if self.config.batch_invariant:
            groups = [[i] for i in range(len(jobs))]
        else:
            groups = group_by_length([len(j.spec.prompt_ids) for j in jobs], self.config.max_batch_tokens)
        for group in groups:
            members = [jobs[i] for i in group]
            if self._running and max(len(j.spec.prompt_ids) for j in members) * len(members) > CHUNKED_PREFILL_TOKENS:
                # long: sliced between decode steps, so running streams are not stalled for its whole prefill
                for job in members:
                    job.begin()
                self._prefilling.append((members, self.runner.prefill_slices(
                    [j.spec.prompt_ids for j in members],
                    [len(j.spec.prompt_ids) + j.spec.max_new_tokens for j in members]), deque(maxlen=SLICE_HISTORY)))
            else:
                self._prefill(members)

    def _advance_prefills(self) -> None:
        """Slices of the prefills in progress, oldest first, within the config's prefill_budget_ms (at least one
        slice each); a finished one joins the running generations."""
        start = time.monotonic()
        budget_s = self.config.prefill_budget_ms / 1000.0
        for entry in list(self._prefilling):
            jobs, slices, recent = entry
            try:
                while True:
                    began = time.monotonic()
                    next(slices)
                    now = time.monotonic()
                    recent.append(now - began)
                    if not another_slice_fits(now - start, recent, budget_s):
                        break
                continue
            except StopIteration as done:
                logits, states = done.value
            except Exception:
                log.exception("sliced prefill failed", extra={"request_id": jobs[0].request_id})
                self._prefilling.remove(entry)
                self._fail_jobs(jobs)
                continue
            self._prefilling.remove(entry)
            self._prefilled(jobs, logits, states)

    def _prefill(self, jobs: list[GenerationJob]) -> None:
        try:
            for job in jobs:
                job.begin()
            logits, states = self.runner.prefill([j.spec.prompt_ids for j in jobs],
                                                 [len(j.spec.prompt_ids) + j.spec.max_new_tokens for j in jobs])
        except Exception:
            if len(jobs) > 1:  # find the request that fails: each one alone
                log.warning("a prefill batch of %d failed; retrying each alone", len(jobs))
                for job in jobs:
                    self._prefill([job])
                return
            log.exception("prefill failed", extra={"request_id": jobs[0].request_id})
            self._fail_jobs(jobs)
            return
        self._prefilled(jobs, logits, states)

    def _prefilled(self, jobs: list[GenerationJob], logits: torch.Tensor, states: list[Any]) -> None:
        self.metrics.batch_size.labels("prefill").observe(len(jobs))
        self.metrics.batch_tokens.labels("prefill").observe(max(len(j.spec.prompt_ids) for j in jobs) * len(jobs))
        deliveries: list[tuple[GenerationJob, Event]] = []
        with self.runner.sampling_scope():
            for job, state, row, choice in zip(jobs, states, logits, self._greedy(jobs, logits), strict=True):
                job.cache = state
                with self._cond:
                    self._running.append(job)
                self._advance_safely(job, row, deliveries, choice)
        deliver_together(deliveries)

    def _decode_step(self) -> None:
        """One batched step over every running generation. A row that cannot step fails alone before the call;
        a failure of the call itself fails the rows in it; each row's sampling and delivery fail alone."""
        jobs = [j for j in self._running if j.state is JobState.RUNNING]
        broken = [j for j in jobs if j.cache is None or j.pending_token is None or not self.runner.can_step(j.cache)]
        if broken:
            log.error("%d generations cannot take another step; failing them", len(broken))
            self._fail_jobs(broken)
            jobs = [j for j in jobs if j not in broken]
        if not jobs:
            return
        try:
            logits = self.runner.decode([j.pending_token for j in jobs], [j.cache for j in jobs])  # type: ignore[misc]
        except Exception:
            log.exception("decode step over %d generations failed", len(jobs))
            self._fail_jobs(jobs)
            return
        # rows per model call: in invariant mode the step may have run in blocks of INVARIANT_ROWS rows
        block = self.runner.last_rows_per_call
        for start in range(0, len(jobs), block):
            rows = min(block, len(jobs) - start)
            self.metrics.batch_size.labels("decode").observe(rows)
            self.metrics.batch_tokens.labels("decode").observe(rows)
        deliveries: list[tuple[GenerationJob, Event]] = []
        with self.runner.sampling_scope():
            for job, row, choice in zip(jobs, logits, self._greedy(jobs, logits), strict=True):
                self._advance_safely(job, row, deliveries, choice)
        deliver_together(deliveries)

    @staticmethod
    def _greedy(jobs: list[GenerationJob], logits: torch.Tensor) -> list[tuple[int, float] | None]:
        """Every row's greedy choice in one batched pass when some request is plain greedy, else Nones."""
        if any(j.sampler is not None and j.sampler.plain_greedy for j in jobs):
            try:
                return list(greedy_choices(logits))
            except Exception:  # each row then samples on its own, and fails alone if it must
                log.exception("batched greedy choice over %d rows failed", len(jobs))
        return [None] * len(jobs)

    def _advance_safely(self, job: GenerationJob, logits: torch.Tensor,
                        deliveries: list[tuple[GenerationJob, Event]], greedy: tuple[int, float] | None) -> None:
        try:
            deliveries.extend((job, event) for event in job.to_deliver(self._advance(job, logits, greedy)))
        except Exception:
            log.exception("sampling or delivery failed", extra={"request_id": job.request_id})
            self._fail_jobs([job])

    def _advance(self, job: GenerationJob, logits: torch.Tensor, greedy: tuple[int, float] | None) -> TokenEvent:
        """Sample the job's next token and retire the job if it is finished; returns the event to deliver."""
        event = job.accept(logits, greedy)
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
            self.metrics.prompt_tokens.inc(len(job.spec.prompt_ids))  # completed requests only
            with self._cond:
                job.state = JobState.DONE
                if job in self._running:
                    self._running.remove(job)
                self._release(job)
        return event
