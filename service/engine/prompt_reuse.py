"""Prompts read once: on the worker thread, before prefills run, each generation is sorted into one that
restores a cached state (a prefix-cache hit), one that copies the state of an identical prompt being prefilled
now (a fork: `n` / `best_of` choices, identical requests), or one that prefills (a leader, whose state is then
offered to the prefix cache and copied to the forks waiting on it).

How a generation's prompt is processed never depends on what is cached (service/prefix_cache/__init__.py):
its segment (the whole prompt, or the part the request declared with `cache_prefix_chars`) is prefilled in one
forward, and the tokens after it are fed as decode steps (`GenerationJob.suffix`). A hit or a fork copies the
state of exactly that prefill (model/decoding/snapshot.py), so its tokens are the leader's bits. A prompt
that asks to be scored (prompt logprobs) always prefills, alone of the cache."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch

from model.decoding.snapshot import restore_snapshot, take_snapshot
from service.engine.jobs_runtime import GenerationJob
from service.prefix_cache.keys import chain_key

if TYPE_CHECKING:
    from service.engine.runner import ModelRunner
    from service.prefix_cache import PrefixCache
    from service.prefix_cache.metrics import PrefixCacheMetrics

log = logging.getLogger("service.engine")

NO_IDENTITY = "00" * 32  # the chain's start when no prefix cache gives one (keys of prompts in flight only)


class Sorted(NamedTuple):
    prefill: list[GenerationJob]
    ready: list[tuple[GenerationJob, torch.Tensor]]
    failed: list[GenerationJob]


class PromptReuse:
    def __init__(self, runner: ModelRunner, cache: PrefixCache | None, metrics: PrefixCacheMetrics | None,
                 report: bool = True) -> None:
        self.runner = runner
        # whether a job's cached_tokens says what it reused (REFORMER_PREFIX_CACHE_REPORT); false: always 0
        self.report = report
        self.cache = cache
        self.metrics = metrics
        # the segment key of every leader being prefilled now -> the forks waiting for its state (their own
        # states allocated when they started, so the blocks admission counted for them are theirs)
        self.waiting: dict[str, list[GenerationJob]] = {}

    def sort(self, jobs: list[GenerationJob]) -> Sorted:
        """The jobs that must prefill (leaders, and prompts that are scored), the hits with their logits (their
        states restored, ready to run), and the jobs that failed here (the caller fails them); forks wait in
        `waiting` for their leader."""
        out = Sorted([], [], [])
        for job in jobs:
            try:
                self._sort_one(job, out)
            except Exception:
                log.exception("looking up or restoring a prompt's state failed", extra={"request_id": job.request_id})
                if job.cache is not None:
                    self.runner.free(job.cache)
                    job.cache = None
                out.failed.append(job)
        return out

    def _sort_one(self, job: GenerationJob, out: Sorted) -> None:
        if job.spec.prompt_logprobs is not None:
            out.prefill.append(job)
            return
        key = job.prefix_key = self._key(job)
        if key in self.waiting:
            self._own_state(job)
            self.waiting[key].append(job)
            return
        found = None
        if self.cache is not None:
            found = self.cache.lookup(key, len(job.prefill_ids), job.read_ahead)
            job.read_ahead = None  # the job holds no copy of a state it no longer needs
        if found is not None:
            snap, tier = found
            self._own_state(job)
            try:
                with torch.inference_mode():
                    restore_snapshot(self.runner.cache, snap, job.cache)
            except Exception:  # the entry is unusable: forget it (memory and disk), and compute what it held
                log.exception("restoring a kept state failed; prefilling instead", extra={"request_id": job.request_id})
                assert self.cache is not None
                self.cache.forget(key)
                self.runner.free(job.cache)
                job.cache = None
            else:
                self.cache.hit(tier, len(job.prefill_ids))  # type: ignore[union-attr]
                job.timings.cached_tokens = snap.length if self.report else 0
                out.ready.append((job, snap.logits))
                return
        self.waiting[key] = []
        out.prefill.append(job)

    def _key(self, job: GenerationJob) -> str:
        salt = job.spec.cache_salt
        if self.cache is not None:
            return self.cache.key(job.prefill_ids, salt)
        # no cache: forks still share one prefill, and a key need only tell apart the prompts in flight (and
        # their salts: a caller never shares another tenant's prefill, nor learns of it from cached_tokens)
        return chain_key(NO_IDENTITY, job.prefill_ids, salt)

    def _own_state(self, job: GenerationJob) -> None:
        """The job starts (its sampler) and gets its own blocks for its prompt plus max_new_tokens, for a kept or
        shared state to be copied into."""
        job.begin()
        job.cache = self.runner.allocate(min(len(job.spec.prompt_ids) + job.spec.max_new_tokens,
                                             self.runner.max_positions))

    def take_forks(self, job: GenerationJob) -> list[GenerationJob] | None:
        """A leader's prefill is done: the forks that waited on it (they run with its logits; `share` fills
        their states before the next decode step), or None when the job leads nothing (a scored prompt)."""
        if job.prefix_key is None:
            return None
        forks = self.waiting.pop(job.prefix_key, [])
        for fork in forks:
            fork.timings.cached_tokens = len(fork.prefill_ids) if self.report else 0
        if self.metrics is not None:
            self.metrics.forks.inc(len(forks))
        return forks

    def share(self, job: GenerationJob, state: object, logits: torch.Tensor, forks: list[GenerationJob]) -> None:
        """After the leader's and its forks' first tokens went out, before the next decode step: offer the
        leader's `state` (and the logits after its segment) to the prefix cache, and copy it into each fork
        still running."""
        key = job.prefix_key
        assert key is not None
        length = len(job.prefill_ids)
        keep = self.cache is not None and self.cache.wants(length, self.runner.cache.bytes_for(length))
        if not keep and not forks:
            return
        with torch.inference_mode():
            # one copy out of the cache serves the prefix cache and every fork
            snap = take_snapshot(self.runner.cache, state, logits)  # type: ignore[arg-type]
            for fork in forks:
                restore_snapshot(self.runner.cache, snap, fork.cache)
        if keep:
            assert self.cache is not None
            try:
                self.cache.offer(key, snap)
            except Exception:  # the cache is an optimisation: the request goes on without it
                log.exception("could not keep a prefilled state in the prefix cache",
                              extra={"request_id": job.request_id})

    def orphans(self, leader: GenerationJob) -> list[GenerationJob]:
        """The forks of a leader that will not finish (it failed or was dropped): the caller fails them."""
        key = leader.prefix_key
        return self.waiting.pop(key, []) if key is not None else []

    def take_all(self) -> list[GenerationJob]:
        jobs = [job for forks in self.waiting.values() for job in forks]
        self.waiting.clear()
        return jobs
