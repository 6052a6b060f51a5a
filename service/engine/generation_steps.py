"""The generations' work on the engine's worker thread: prefills (together, grouped by length, or sliced
between decode steps when long), one batched decode step over every running generation, and each row's
sampling and delivery. `GenerationSteps` owns the generations past the queue (running, or prefilling in
slices); `Engine` (service/engine/core.py) owns one, hands it the generations that start and calls its steps from
its loop. A failure in one request's work fails that request only."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Generator, Iterable
from typing import Any, NamedTuple

import torch

from model.sampling import greedy_choices
from service.engine.constrained import ConstrainedRows
from service.engine.jobs_runtime import Event, GenerationJob, Job, JobState, deliver_together
from service.engine.policy import SLICE_HISTORY, another_slice_fits, group_by_length
from service.engine.prompt_reuse import PromptReuse, tail_boundaries
from service.engine.runner import ModelRunner
from service.errors import InternalError
from service.jobs import TokenEvent
from service.observability.metrics import ServiceMetrics

log = logging.getLogger("service.engine")

# A prefill group of more padded tokens than this is sliced between decode steps, whether or not generations
# run when it starts: a request that arrives during its prefill is then admitted and decodes between slices
# (in one piece, a 500K-token prompt kept a 1K-token request that came 2 s later waiting 25 s for its first
# token: bench/serving/long_prompt_500k.py).
CHUNKED_PREFILL_TOKENS = 2048


class SlicedPrefill(NamedTuple):
    """A long prompt group being prefilled slice by slice between decode steps."""

    jobs: list[GenerationJob]
    slices: Generator[None, None, Any]  # one slice per next(); returns (logits, states)
    recent: deque[float]  # the durations of its last few slices


class GenerationSteps:
    """The running generations and those being prefilled in slices, and the steps that advance them.

    `running` and `prefilling` change under `cond` (the engine's lock: its handlers read them for stats and
    cancellation); the steps themselves run on the worker thread outside it."""

    def __init__(self, runner: ModelRunner, metrics: ServiceMetrics, cond: threading.Condition, *,
                 batch_invariant: bool, max_batch_tokens: int, prefill_budget_s: float,
                 reuse: PromptReuse | None = None, causal: bool = False) -> None:
        self.runner = runner
        self.causal = causal  # REFORMER_PREFILL=causal: every prompt read by runner.extend_slices
        # prefix-cache hits and forks of identical prompts (service/engine/prompt_reuse.py)
        self.reuse = reuse if reuse is not None else PromptReuse(runner, None, None)
        self.metrics = metrics
        self.cond = cond
        self.batch_invariant = batch_invariant  # prompts prefilled one at a time
        self.max_batch_tokens = max_batch_tokens
        # between two decode steps, sliced prefills run while the next slice still fits in this (at least one)
        self.prefill_budget_s = prefill_budget_s
        self.running: list[GenerationJob] = []
        self.prefilling: list[SlicedPrefill] = []
        # started jobs waiting for free blocks (prompt_reuse.py Sorted.blocked): the engine takes them again, before
        # any queued job, once they fit (service/engine/core.py `_take_prefills`)
        self.blocked: list[GenerationJob] = []
        self._held: set[int] = set()  # ids of states copied from after their first tokens (`_prefilled`)
        self._deferred: list[Any] = []  # those states whose jobs finished meanwhile: freed after the copies
        self.constrained = ConstrainedRows(metrics.structured.mask_time.observe)  # structured output's masks

    @property
    def busy(self) -> bool:
        return bool(self.running or self.prefilling)

    @property
    def rows(self) -> int:
        """The generations that take a row of the decode steps: running, or prefilling to run next."""
        readers = self.reuse.readers
        return (len(self.running) + sum(len(entry.jobs) for entry in self.prefilling) + len(self.blocked)
                + (len(readers) if readers is not None else 0))

    def release(self, job: GenerationJob, keep: bool = True) -> None:
        """The job's decode cache goes back to the allocator (its blocks and slot), then the job forgets it (a
        prefilled state still to be copied from is freed after the copies: `_prefilled`). `keep`: its prompt's
        blocks stay behind for a later request to share (PromptReuse.retire); not after an error."""
        if job.cache is not None and id(job.cache) in self._held:
            self._deferred.append(job.cache)
        else:
            if keep:
                self.reuse.retire(job.cache)
            self.runner.free(job.cache)
        job.release()

    def fail(self, jobs: Iterable[Job]) -> None:
        """The jobs end with an internal error; a generation among them stops running and frees its cache (and
        the forks waiting for its prefill fail with it)."""
        jobs = list(jobs)
        jobs += [fork for job in jobs if isinstance(job, GenerationJob) for fork in self.reuse.orphans(job)]
        with self.cond:
            for job in jobs:
                job.state = JobState.DONE
                if isinstance(job, GenerationJob):
                    self.release(job, keep=False)
                    if job in self.running:
                        self.running.remove(job)
        for job in jobs:
            job.fail(InternalError("internal error; the server log has the details"))

    def drop_cancelled(self) -> None:
        """Under the lock: running generations whose client went away stop and free their cache; so do forks
        waiting for a prefill (service/engine/prompt_reuse.py), and a sliced prefill once every job of its group, and
        every fork waiting on it, has gone. One with a job still waiting runs on: a row cannot leave a batched
        prefill midway; the gone jobs get no token when it ends (`_start`)."""
        for job in [j for j in self.running if j.cancel_requested]:
            self.running.remove(job)
            self._drop(job, "decode")
        for job in [j for j in self.blocked if j.cancel_requested]:
            self.blocked.remove(job)
            self._drop(job, "prefill")
        if self.reuse.readers is not None:
            for job in self.reuse.readers.drop_cancelled():
                self._drop(job, "prefill")
        for forks in self.reuse.waiting.values():
            for fork in [f for f in forks if f.cancel_requested]:
                forks.remove(fork)
                self._drop(fork, "prefill")
        for entry in [e for e in self.prefilling if self._all_gone(e.jobs)]:
            self.prefilling.remove(entry)
            entry.slices.close()  # frees the cache the unfinished prefill held
            for job in entry.jobs:
                self.reuse.orphans(job)  # its prompt is no longer being prefilled: a later one leads anew
                self._drop(job, "prefill")
        self._unwait()

    def _unwait(self) -> None:
        """Under the lock: prompts that waited for a reader of their prefix (prefix_readers.py), whose state is
        kept now or who left, start again before any queued job (as `blocked` jobs do)."""
        if self.reuse.readers is not None and self.reuse.readers.released:
            self.blocked.extend(self.reuse.readers.take_released())

    def _all_gone(self, leaders: list[GenerationJob]) -> bool:
        """Whether no client waits for these jobs' prefill: neither theirs nor a fork's."""
        return all(j.cancel_requested for j in leaders) and not any(
            self.reuse.waiting.get(j.prefix_key or "") for j in leaders)

    def _drop(self, job: GenerationJob, stage: str) -> None:
        """Under the lock: the job's client went away at `stage`; it ends and frees its cache."""
        job.state = JobState.DONE
        self.release(job)
        self.metrics.dropped.labels(stage).inc()
        log.info("dropped a generation at %s: its client went away", stage, extra={"request_id": job.request_id})

    def close_prefills(self) -> None:
        """Outside the lock: the sliced prefills in progress stop and free the cache they held (their jobs stay
        in `prefilling` for `take_all`)."""
        for entry in self.prefilling:
            entry.slices.close()

    def take_all(self) -> list[GenerationJob]:
        """Under the lock: every running or prefilling generation, forgotten here (the engine fails them)."""
        jobs = [*self.running, *(job for entry in self.prefilling for job in entry.jobs), *self.reuse.take_all(),
                *self.blocked]
        self.running.clear()
        self.prefilling.clear()
        self.blocked.clear()
        return jobs

    def prefill_all(self, jobs: list[GenerationJob]) -> None:
        """Prompts prefilled together, grouped by length under max_batch_tokens (one at a time when the
        engine runs batch-invariant, so a request's first token does not depend on its company). Prefix-cache hits
        run at once; forks of a prompt being prefilled wait for it (service/engine/prompt_reuse.py). A job whose client
        left since it was taken is dropped before any of its prompt runs."""
        with self.cond:
            for job in [j for j in jobs if j.cancel_requested]:
                self._drop(job, "prefill")
            jobs = [j for j in jobs if not j.cancel_requested]
        jobs, ready, failed, blocked = self.reuse.sort(jobs)
        if failed:
            self.fail(failed)
        if blocked:
            with self.cond:
                self.blocked.extend(blocked)
        if ready:
            self._start([job for job, _ in ready], [job.cache for job, _ in ready],
                         torch.stack([logits for _, logits in ready]))
        if self.causal:  # each prompt read alone, in slices; a scored one from position 0, scored row by row
            for job in jobs:
                job.begin()
                self.prefilling.append(SlicedPrefill([job], self._causal_slices(job), deque(maxlen=SLICE_HISTORY)))
            return
        if not jobs:
            return
        if self.batch_invariant:
            groups = [[i] for i in range(len(jobs))]
        else:
            groups = group_by_length([len(j.prefill_ids) for j in jobs], self.max_batch_tokens)
        for group in groups:
            members = [jobs[i] for i in group]
            if max(len(j.prefill_ids) for j in members) * len(members) > CHUNKED_PREFILL_TOKENS:
                # long: sliced between decode steps, so neither running streams nor requests that arrive
                # meanwhile wait for its whole prefill
                for job in members:
                    job.begin()
                self.prefilling.append(SlicedPrefill(members, self._slices(members), deque(maxlen=SLICE_HISTORY)))
            else:
                self._prefill(members)

    def advance_prefills(self) -> None:
        """Slices of the prefills in progress, oldest first, within `prefill_budget_s` (at least one slice
        each); a finished one joins the running generations."""
        start = time.monotonic()
        for entry in list(self.prefilling):
            jobs, slices, recent = entry
            try:
                while True:
                    began = time.monotonic()
                    next(slices)
                    now = time.monotonic()
                    recent.append(now - began)
                    for job in jobs:
                        job.timings.prefill.add_slice(began, now)
                    if self._all_gone(jobs):  # nobody waits for it: the next turn's drop_cancelled closes it
                        break
                    if not another_slice_fits(now - start, recent, self.prefill_budget_s):
                        break
                continue
            except StopIteration as done:
                logits, states, *scored = done.value  # a scored prefill adds the prompts' scores
            except Exception:
                log.exception("sliced prefill failed", extra={"request_id": jobs[0].request_id})
                self.prefilling.remove(entry)
                self.fail(jobs)
                continue
            self.prefilling.remove(entry)
            self._prefilled(jobs, logits, states, scored[0] if scored else None)
        with self.cond:
            self._unwait()

    @staticmethod
    def _scoring(jobs: list[GenerationJob]) -> list[int | None] | None:
        """What each job's prompt asks to be scored with (None: no job asks; the plain prefill runs)."""
        asked = [j.spec.prompt_logprobs for j in jobs]
        return asked if any(k is not None for k in asked) else None

    def _slices(self, jobs: list[GenerationJob]) -> Generator[None, None, tuple[Any, ...]]:
        prompts = [j.prefill_ids for j in jobs]
        reserve = [len(j.spec.prompt_ids) + j.spec.max_new_tokens for j in jobs]
        asked = self._scoring(jobs)
        if asked is not None:
            return self.runner.prefill_scored_slices(prompts, reserve, asked)
        return self.runner.prefill_slices(prompts, reserve)

    def _causal_slices(self, job: GenerationJob) -> Generator[None, None, tuple[Any, ...]]:
        """A causal prompt read from the state it starts from (`job.cache`: restored from the prefix cache, or
        None; always None for a scored prompt, whose every position is scored from its own logits), its state
        offered to the prefix cache on the way at the boundary `reuse.keep_at` picks. Returns the logits and
        the state, and a scored prompt's scores."""
        keep = self.reuse.keep_at(job)
        reserve = len(job.spec.prompt_ids) + job.spec.max_new_tokens
        # the boundaries up to the kept one that get a tail, so the kept state serves prompts sharing less of it
        stops = () if keep is None else tail_boundaries(keep)
        steps = self.runner.extend_slices(job.prefill_ids, reserve, job.cache, stops=stops,
                                          score=job.spec.prompt_logprobs)
        while True:
            try:
                length, logits, state = next(steps)
            except StopIteration as done:
                logits, state, scores = done.value
                self.reuse.read(job)
                if scores is None:
                    return logits.unsqueeze(0), [state]
                return logits.unsqueeze(0), [state], [scores]
            self.reuse.reading(job, state)  # a holder of the prefix it has read (service/engine/live_prefixes.py)
            if length in stops:
                self.reuse.keep_tail(job, state, logits)
            if length == keep:
                self.reuse.keep(job, state, logits, length)
            try:
                yield
            except GeneratorExit:
                steps.close()
                raise

    def _prefill(self, jobs: list[GenerationJob]) -> None:
        scores = None
        try:
            for job in jobs:
                job.begin()
            prompts = [j.prefill_ids for j in jobs]
            reserve = [len(j.spec.prompt_ids) + j.spec.max_new_tokens for j in jobs]
            asked = self._scoring(jobs)
            began = time.monotonic()
            if asked is not None:
                logits, states, scores = self.runner.prefill_scored(prompts, reserve, asked)
            else:
                logits, states = self.runner.prefill(prompts, reserve)
            ended = time.monotonic()
            for job in jobs:
                job.timings.prefill.add_slice(began, ended)
        except Exception:
            if len(jobs) > 1:  # find the request that fails: each one alone
                log.warning("a prefill batch of %d failed; retrying each alone", len(jobs))
                for job in jobs:
                    self._prefill([job])
                return
            log.exception("prefill failed", extra={"request_id": jobs[0].request_id})
            self.fail(jobs)
            return
        self._prefilled(jobs, logits, states, scores)

    def _prefilled(self, jobs: list[GenerationJob], logits: torch.Tensor, states: list[Any],
                   scores: list[Any] | None = None) -> None:
        """`scores`: each job's prompt scores when the prefill scored them (its first token carries them)."""
        self.metrics.batch_size.labels("prefill").observe(len(jobs))
        self.metrics.batch_tokens.labels("prefill").observe(max(len(j.prefill_ids) for j in jobs) * len(jobs))
        for i, job in enumerate(jobs):
            job.prompt_scores = scores[i] if scores is not None else None
        # the forks that waited on these prompts start with their leader's logits; the leaders' states are
        # shared with the forks (and copied out to the prefix cache) once every first token has gone out, so
        # that delays no first token, and before the next decode step changes a state
        leaders = [(i, job, group) for i, job in enumerate(jobs) if (group := self.reuse.take_forks(job)) is not None]
        forks = [(fork, i) for i, _, group in leaders for fork in group]
        if forks:
            jobs = [*jobs, *(fork for fork, _ in forks)]
            states = [*states, *(fork.cache for fork, _ in forks)]
            logits = torch.cat([logits, logits[[i for _, i in forks]]])
        self._held = {id(states[i]) for i, _, _ in leaders}  # a leader that finishes at once frees after the copies
        try:
            self._start(jobs, states, logits)
        finally:
            self._held = set()
        for i, leader, group in leaders:
            live = [fork for fork in group if fork.cache is not None]  # a fork may have finished or left already
            try:
                self.reuse.share(leader, states[i], logits[i], live)
            except Exception:
                log.exception("sharing a prefilled state with its forks failed",
                              extra={"request_id": leader.request_id})
                self.fail(live)
        deferred, self._deferred = self._deferred, []
        for state in deferred:
            self.reuse.retire(state)
            self.runner.free(state)

    def _start(self, jobs: list[GenerationJob], states: list[Any], logits: torch.Tensor) -> None:
        """The jobs run from their states: each samples its first token from its row of `logits`, or, when its
        prompt goes on after its segment, feeds the next prompt token to the decode steps first."""
        deliveries: list[tuple[GenerationJob, Event]] = []
        if (masked := self.constrained.first(jobs, states, logits, self.fail)) is None:
            return
        with self.runner.sampling_scope():
            for job, state, row, choice in zip(jobs, states, masked, _greedy(jobs, masked), strict=True):
                job.cache = state
                with self.cond:
                    if job.cancel_requested:  # its client left during the prefill: no token for nobody
                        self._drop(job, "prefill")
                        continue
                    self.running.append(job)
                if job.feeding:
                    job.feed_next()
                else:
                    self._advance_safely(job, row, deliveries, choice)
        deliver_together(deliveries)

    def decode_step(self) -> None:
        """One batched step over every running generation. A row that cannot step fails alone before the call;
        a failure of the call itself fails the rows in it; each row's sampling and delivery fail alone."""
        jobs = [j for j in self.running if j.state is JobState.RUNNING]
        broken = [j for j in jobs if j.cache is None or j.pending_token is None or not self.runner.can_step(j.cache)]
        if broken:
            log.error("%d generations cannot take another step; failing them", len(broken))
            self.fail(broken)
            jobs = [j for j in jobs if j not in broken]
        if not jobs:
            return
        try:
            masks = self.constrained.start(jobs)  # computed while the model's step runs
            logits = self.runner.decode([j.pending_token for j in jobs], [j.cache for j in jobs])  # type: ignore[misc]
            logits = self.constrained.apply(masks, logits, jobs)
        except Exception:
            log.exception("decode step over %d generations failed", len(jobs))
            self.fail(jobs)
            return
        # rows per model call: in invariant mode the step may have run in blocks of INVARIANT_ROWS rows
        block = self.runner.last_rows_per_call
        for start in range(0, len(jobs), block):
            rows = min(block, len(jobs) - start)
            self.metrics.batch_size.labels("decode").observe(rows)
            self.metrics.batch_tokens.labels("decode").observe(rows)
        deliveries: list[tuple[GenerationJob, Event]] = []
        with self.runner.sampling_scope():
            for job, row, choice in zip(jobs, logits, _greedy(jobs, logits), strict=True):
                if job.feeding:  # still reading its prompt: nothing to sample yet
                    job.feed_next()
                else:
                    self._advance_safely(job, row, deliveries, choice)
        deliver_together(deliveries)

    def _advance_safely(self, job: GenerationJob, logits: torch.Tensor,
                        deliveries: list[tuple[GenerationJob, Event]], greedy: tuple[int, float] | None) -> None:
        try:
            deliveries.extend((job, event) for event in job.to_deliver(self._advance(job, logits, greedy)))
        except Exception:
            log.exception("sampling or delivery failed", extra={"request_id": job.request_id})
            self.fail([job])

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
            with self.cond:
                job.state = JobState.DONE
                if job in self.running:
                    self.running.remove(job)
                self.release(job)
        return event


def _greedy(jobs: list[GenerationJob], logits: torch.Tensor) -> list[tuple[int, float] | None]:
    """Every row's greedy choice in one batched pass when some request is plain greedy, else Nones."""
    if any(j.sampler is not None and j.sampler.plain_greedy for j in jobs):
        try:
            return list(greedy_choices(logits))
        except Exception:  # each row then samples on its own, and fails alone if it must
            log.exception("batched greedy choice over %d rows failed", len(jobs))
    return [None] * len(jobs)
