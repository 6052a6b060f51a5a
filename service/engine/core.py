"""The model executor: ONE worker thread owns the model and the device; handlers only enqueue and await.

The engine in parts: `service/engine/admission.py` (queue bound, reservations, queue timeouts),
`service/engine/policy.py`
(pure functions: which generations start, how prompts are grouped, which embedding batch runs),
`service/engine/runner.py` (the model runner: device tensors, the decode cache, batched prefill and decode steps),
`service/engine/embed_batches.py` (the queued inputs of embedding requests and their batches),
`service/engine/jobs_runtime.py` (per-request state and delivery to the event loop),
`service/engine/generation_steps.py`
(an object the engine owns: the generations past the queue, their prefills and decode steps) and, here, the
requests' entry and the worker loop that ties them together. Each turn: start the queued generations the
policy and the decode cache allow (prefilled together, grouped by length under `max_batch_tokens`, or sliced
between decode steps when long, so requests that arrive meanwhile start between its slices), run ONE batched
decode step over every running generation (continuous batching: requests join and leave between steps), then
one embedding batch if one is ready. A failure in one request's work fails that request only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from model.decoding.extend import c_path as extend_in_c
from model.kernels.weights import WeightKind
from service.engine.admission import Admission, Reservation
from service.engine.backends import EmbeddingBackend
from service.engine.embed_batches import EmbedBatches
from service.engine.generation_steps import GenerationSteps
from service.engine.jobs_runtime import EmbedJob, GenerationJob, GenerationStream, Job, JobState
from service.engine.policy import QueuedGeneration, take_generations
from service.engine.prompt_reuse import PromptReuse
from service.engine.runner import ModelRunner, default_prefix_cache_bytes
from service.errors import InputTooLong, InternalError, Overloaded, ServiceError, Unavailable
from service.jobs import EmbeddingResult, EmbeddingSpec, GenerationSpec
from service.memory import HeapKeeper
from service.observability.logs import working_on
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import note_job
from service.prefix_cache import CacheIdentity, PrefixCache, PrefixCacheConfig
from service.prefix_cache.fingerprint import runtime_fingerprint

log = logging.getLogger("service.engine")

# Reservation lives in service/engine/admission.py and GenerationStream in service/engine/jobs_runtime.py; importers of
# service.engine.core keep them.
__all__ = ["Engine", "EngineConfig", "GenerationStream", "Reservation"]


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_wait_ms: float = 5.0
    max_queue_size: int = 64
    request_timeout_s: float = 60.0
    warmup: bool = True
    cache_bytes: int | None = None  # decode-cache capacity; None: service/engine/runner.py's default share
    batch_invariant: bool = False  # decode steps in fixed row blocks: bit-identical to a request alone
    max_request_tokens: int | None = None  # longest prompt plus max_new_tokens admitted; None: max positions
    cuda_graphs: bool = False  # on CUDA, decode steps replay captured graphs (model/decoding/steps/cuda_graphs.py)
    cpu_kernels: bool = True  # on CPU, decode steps attend through the C window kernel (model/kernels/bindings.py)
    kv_cache_dtype: torch.dtype | None = None  # the decode cache's keys and values; None: the model's dtype
    decode_weights: WeightKind = "float32"  # the C decode step's linear weights (model/kernels/weights.py)
    # Between two decode steps, sliced prefills run slice after slice while the next one, if it takes as long
    # as the longest of the last few (service/engine/policy.py another_slice_fits), still ends within this much time
    # (at least one slice per step; 0: one slice per step). A running stream's gap is then about one decode
    # step plus this (model/decoding/prefill/slices.py bounds a slice), and the prefill keeps about budget / (budget +
    # decode step) of the time (bench/prefill/prefill_gap.py measures both; REFORMER_PREFILL_BUDGET_MS)
    prefill_budget_ms: float = 100.0
    idle_trim_s: float = 2.0  # idle this long: the heap's free pages go back to the system (service/memory.py)
    memory_budget_bytes: int = 0  # RSS above which the worker trims between turns too; 0: only when idle
    busy_trim_s: float = 30.0  # busy this long since the last trim: trim between turns (0: never)
    # after a request finishes, the decode cache's pool pages of free blocks beyond the lowest this many bytes go
    # back to the system (service/memory.py HeapKeeper; None: only idle or over the budget); except over the budget,
    # what a restore of the longest state the prefix cache holds in memory takes stays resident too (`_hot_bytes`)
    cache_keep_bytes: int | None = 64 * 2**20
    # the prefix cache (service/prefix_cache/): None turns it off (forks of identical prompts still share one
    # prefill); its capacity None: service/engine/runner.py default_prefix_cache_bytes
    prefix_cache: PrefixCacheConfig | None = None
    report_cached_tokens: bool = True  # REFORMER_PREFIX_CACHE_REPORT: false, every cached_tokens says 0
    artifact_sha256: str = ""  # what the prefix cache's keys start from (with the settings that change bits)
    # REFORMER_PREFILL: "causal", every prompt read as decode steps read tokens (service/engine/runner.py
    # extend_slices), its state kept and found at block boundaries with no declaration (prompt_reuse.py);
    # "one-piece"; "auto", causal where the C extend runs (CPU kernels, fixed bucket counts), one-piece elsewhere
    # (there the causal read is one decode step per token). `Engine.causal_prefill` is what it resolves to.
    prefill: str = "one-piece"
    # forks (`n` / `best_of` choices, identical prompts) share their leader's prompt blocks (DecodeCache.fork), a
    # causal prompt restored from the prefix cache shares its first blocks with a running request of the same
    # prefix (prompt_reuse.py `_continue_causal`), and admission reserves only their own part; False: each holds
    # a copy (a snapshot restored)
    shared_blocks: bool = True


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
        self.runner = ModelRunner(model, device, config.max_batch_size, config.cache_bytes, config.batch_invariant,
                                  config.max_request_tokens, config.cuda_graphs, config.cpu_kernels,
                                  config.kv_cache_dtype, config.decode_weights)
        # what REFORMER_PREFILL resolves to on this model and device
        self.causal_prefill = config.prefill == "causal" or (config.prefill == "auto"
                                                             and extend_in_c(self.runner.decoder))
        self.prefix_cache = self._prefix_cache(model, config, metrics)
        # the generations past the queue (running, or prefilling in slices) and the steps that advance them
        self.generations = GenerationSteps(self.runner, metrics, self._cond, batch_invariant=config.batch_invariant,
                                           max_batch_tokens=config.max_batch_tokens,
                                           prefill_budget_s=config.prefill_budget_ms / 1000.0,
                                           reuse=PromptReuse(self.runner, self.prefix_cache, metrics.prefix_cache,
                                                             report=config.report_cached_tokens,
                                                             causal=self.causal_prefill,
                                                             share_blocks=config.shared_blocks),
                                           causal=self.causal_prefill)
        self.memory = HeapKeeper(config.idle_trim_s, config.memory_budget_bytes,
                                 release=self.runner.release_free_pages, keep_bytes=config.cache_keep_bytes,
                                 busy_trim_s=config.busy_trim_s,
                                 hot_bytes=self._hot_bytes if self.prefix_cache is not None else None,
                                 forget=self.generations.reuse.drop_kept)
        self._to_key: list[GenerationJob] = []  # queued since the worker's last `_key_queued`, under the lock
        self._stopping = False
        self._dead = False
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reformer-model-worker", daemon=True)

    def _hot_bytes(self) -> int:
        """What a restore of the longest state the prefix cache holds in memory takes of the decode cache: the
        lowest free blocks, whose pages therefore stay resident (HeapKeeper `hot_bytes`), so that a hit writes
        resident pages instead of faulting in a fresh page for every 2 MiB it restores (the second question
        about a document: bench/prefill/causal_prefill.py)."""
        assert self.prefix_cache is not None  # passed to HeapKeeper only with a prefix cache
        longest = self.prefix_cache.store.longest()
        # not less the kept prefixes' blocks (resident too): the next document's first read writes these pages
        return self.runner.cache.bytes_for(longest) if longest else 0

    def _prefix_cache(self, model: Any, config: EngineConfig, metrics: ServiceMetrics) -> PrefixCache | None:
        wanted = config.prefix_cache
        if wanted is None:
            return None
        cache = self.runner.cache
        if wanted.capacity_bytes < 0:  # unset: a share of the decode cache's, within the host's
            wanted = dataclasses.replace(wanted, capacity_bytes=default_prefix_cache_bytes(cache.capacity_bytes,
                                                                                           cache.device))
        identity = CacheIdentity(
            artifact_sha256=config.artifact_sha256, hash_seed=model.config.hash_seed,
            model_dtype=str(cache.dtype), kv_cache_dtype=str(cache.kv_dtype),
            device_type=cache.device.type, recent_size=next(
                (ix.recent_size for ix in cache.indexes if ix is not None), 0),
            batch_invariant=config.batch_invariant, config_digest=CacheIdentity.config_digest_of(model.config),
            runtime=json.dumps(runtime_fingerprint(cache.device, config.cpu_kernels), sort_keys=True),
            prefill="causal" if self.causal_prefill else "one-piece")
        return PrefixCache(identity, wanted, metrics.prefix_cache, vocab_size=model.config.vocab_size,
                           device=cache.device)

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
                "running": len(self.generations.running),
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
        if self.causal_prefill and spec.cache_prefix_tokens is not None:
            # a causal prompt's every block boundary is found by its content: a declared part changes nothing
            spec = dataclasses.replace(spec, cache_prefix_tokens=None)
        job = GenerationJob(spec, asyncio.get_running_loop(), request_id, self.tokenizer, stream)
        self._admit(job, lambda: self._enqueue(job), reservation)
        return GenerationStream(job, self.cancel)

    def _enqueue(self, job: GenerationJob) -> None:
        """Under the lock: queue the job, and with a disk tier have its prompt's keys hashed and its segment's
        state read off the event loop and the worker's thread first (`_disk_keys`, on the prefix cache's reader
        thread); the job waits in the queue (and so does everything behind it) until that is done."""
        cache = self.prefix_cache
        if cache is not None and cache.disk is not None and job.spec.prompt_logprobs is None:
            job.read_ahead_pending = True
            cache.read_ahead(lambda: self._disk_keys(job), self.runner.cache,
                             lambda snap: self._read_ahead_done(job, snap))
        else:
            self._to_key.append(job)  # keyed by the worker off the lock (`_key_queued`)
        self._gen_queue.append(job)

    def _disk_keys(self, job: GenerationJob) -> list[str]:
        """On the reader thread: the keys a queued job's state is looked for on disk under, longest first (none
        when memory holds it or it is too short to be kept). A causal prompt's key chain is kept on the job
        (`job.links`) for the worker (prompt_reuse.py), which reads it only once the read is done."""
        cache = self.prefix_cache
        assert cache is not None
        reuse = self.generations.reuse
        key = reuse.job_key(job)  # the worker's key (and a causal prompt's chain), hashed once
        if self.causal_prefill:  # the longest boundary of the prompt on disk (prompt_reuse.py)
            return cache.causal_read_ahead(reuse.short_links(job))
        return [key] if cache.wants_read_ahead(key, len(job.prefill_ids)) else []

    def _read_ahead_done(self, job: GenerationJob, snap: Any) -> None:
        with self._cond:
            job.read_ahead, job.read_ahead_pending = snap, False
            self._cond.notify_all()

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
        job.timings.admitted = time.monotonic()
        note_job(job.timings)  # the request's trace makes spans of the timings once it is answered

    def cancel(self, job: Job) -> None:
        """The client went away: drop queued work now, running work at the worker's next step."""
        with self._cond:
            if job.state is JobState.PENDING:
                self._finish_pending(job)
                self.metrics.dropped.labels("queued").inc()
            elif job.state is JobState.RUNNING and isinstance(job, EmbedJob):
                # A batch in flight finishes and is discarded; the job's other inputs leave the queue, and a
                # batch taken but not yet run leaves its inputs out (EmbedBatches.run).
                job.state = JobState.DONE
                self.metrics.dropped.labels("embed").inc()
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
        gc.unfreeze()  # what this engine's start-up froze can be collected again once it is gone
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # queued disk writes finish
        self.generations.constrained.close()

    # ---- worker thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.config.warmup:
                self._warm_up()
            # the objects of start-up (the model's modules, the tokenizer, the libraries') are never garbage
            # cycles: left out of the collector's full passes, which scanned them all and held the interpreter
            # 0.13-0.14 s mid-request (268,935 objects, in-process server of the shipped model). `stop` undoes it.
            # Not with REFORMER_DEBUG_MEMORY: its walk over gc.get_objects() would not see them
            if not getattr(self.metrics, "debug_memory", False):
                gc.freeze()
            self.ready.set()
            while True:
                self._key_queued()
                with self._cond:
                    if self._stopping:
                        break
                    self._drop_cancelled()
                    prefills = self._take_prefills()
                    batch, wake_at = self.embeds.take(self._start, flush=self._stopping)
                    trim = False
                    if not prefills and not self.generations.busy and batch is None:
                        timeout = None if wake_at is None else max(wake_at - time.monotonic(), 0.0)
                        # idle with nothing queued either: once per idle spell the heap is trimmed
                        trim = self.memory.idle_turn(not self._gen_queue and not self.embeds.items)
                        if not trim:
                            self._cond.wait(self.memory.idle_wait(timeout))
                            continue
                if trim:  # outside the lock, so requests are admitted meanwhile; never raises
                    self.memory.trim("idle")
                    continue
                # each stage's log lines (the model's own too) name the requests it works for
                if prefills:
                    with working_on(j.request_id for j in prefills):
                        self.generations.prefill_all(prefills)
                if self.generations.prefilling:
                    with working_on(j.request_id for e in self.generations.prefilling for j in e.jobs):
                        self.generations.advance_prefills()
                if self.generations.running:
                    with working_on(j.request_id for j in self.generations.running):
                        self.generations.decode_step()
                if batch is not None:
                    with working_on(it.job.request_id for it in batch):
                        self.embeds.run(batch, self.generations.fail)
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
        self.generations.close_prefills()
        with self._cond:
            jobs: list[Job] = [*self._gen_queue, *self.embeds.jobs(), *self.generations.take_all()]
            self._gen_queue.clear()
            self.embeds.clear()
            self.admission.clear()
            for job in jobs:
                job.state = JobState.DONE
                if isinstance(job, GenerationJob):
                    self.generations.release(job, keep=False)
        for job in {id(j): j for j in jobs}.values():
            job.fail(error)

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
        self.generations.drop_cancelled()

    def _start(self, job: Job) -> None:
        self.admission.start(job)

    def _key_queued(self) -> None:
        """Outside the lock: the queued generations' prompt keys (and a causal prompt's key chain: about 12 ms
        for 500K tokens), which admission reads under the lock the event loop takes to queue a request. A job
        whose disk read is pending gets its chain on the reader thread (`_disk_keys`)."""
        with self._cond:
            todo, self._to_key = self._to_key, []
        for job in todo:
            if job.state is JobState.PENDING:  # not dropped meanwhile
                self.generations.reuse.job_key(job)

    def _take_prefills(self) -> list[GenerationJob]:
        """Under the lock: the generations that start now (service/engine/policy.py decides). Started jobs that
        found too few free blocks, or waited for a reader of their prefix (GenerationSteps.blocked), go first, alone,
        as many from the first as fit whole now; no queued job starts before them."""
        blocked = self.generations.blocked
        if blocked:
            # the longest run from the first whose whole sizes fit now: jobs released at different turns (waiters
            # of several readers) may never fit all together, while each one alone does once the cache empties
            sizes = [len(j.spec.prompt_ids) + j.spec.max_new_tokens for j in blocked]
            n = 0
            while n < len(blocked) and self.runner.fits_together(sizes[: n + 1]):
                n += 1
            taken = blocked[:n]
            del blocked[:n]
            return taken
        # a job whose disk read is still running waits, and so does everything behind it (FIFO)
        ready = next((i for i, j in enumerate(self._gen_queue) if j.read_ahead_pending), len(self._gen_queue))
        # no more than the batch has rows left for (take_generations stops there): what admission works out for
        # each head (a prefix-cache peek, live holders) runs under the lock, every loop turn
        room = max(self.config.max_batch_size - self.generations.rows, 0)
        heads = list(itertools.islice(self._gen_queue, min(ready, room)))
        # a fork reserves only what it does not share with its leader, and a causal prefix-cache hit what it does
        # not share with a live holder of its prefix: its own blocks and a spare order block for each shared one
        # (prompt_reuse.py `shared_blocks`); where the spare order blocks lack, they copy the whole state instead
        # (prompt_reuse.py `_own_state`, `_allocate_sharing`), so the jobs also fit when their full sizes do
        shared = self.generations.reuse.shared_blocks(heads)
        block = self.runner.cache.block_size
        full = [len(j.spec.prompt_ids) + j.spec.max_new_tokens for j in heads]
        queued = [QueuedGeneration(len(j.spec.prompt_ids), n - k * block)
                  for j, n, k in zip(heads, full, shared, strict=True)]

        def fits(counts: Sequence[int]) -> bool:
            taken = len(counts)
            return (self.runner.fits_together(counts, sum(shared[:taken]))
                    or self.runner.fits_together(full[:taken]))

        n = take_generations(queued, self.generations.rows, self.config.max_batch_size,
                             self.config.max_batch_tokens, fits)
        taken = [self._gen_queue.popleft() for _ in range(n)]
        for job in taken:
            self._start(job)
        return taken
