"""The embedding side of the worker loop: the queued inputs of embedding requests (one per sequence), the
next batch the policy picks from them (service/engine/policy.py pick_embed_batch), and its run through the
embedding backend. The engine owns the lock and calls these from its worker thread; a failed batch fails
its requests alone."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.backends import EmbeddingBackend
from service.engine.jobs_runtime import EmbedJob, Job, JobState
from service.engine.policy import QueuedInput, pick_embed_batch
from service.observability.metrics import ServiceMetrics

log = logging.getLogger("service.engine")


@dataclass
class EmbedItem:
    """One sequence of an embedding request: its job, its index in the request, its token ids."""

    job: EmbedJob
    index: int
    ids: list[int]


class EmbedBatches:
    def __init__(self, backend: EmbeddingBackend, pad_id: int, metrics: ServiceMetrics, cond: threading.Condition,
                 max_batch_size: int, max_batch_tokens: int, max_wait_s: float) -> None:
        self.backend = backend
        self.pad_id = pad_id
        self.metrics = metrics
        self.cond = cond  # the engine's lock: a job's state changes under it
        self.max_batch_size, self.max_batch_tokens, self.max_wait_s = max_batch_size, max_batch_tokens, max_wait_s
        self.items: list[EmbedItem] = []

    def enqueue(self, job: EmbedJob) -> None:
        """Under the lock: every sequence of the request joins the queue."""
        self.items.extend(EmbedItem(job, i, ids) for i, ids in enumerate(job.spec.sequences))

    def jobs(self) -> Iterator[EmbedJob]:
        return (item.job for item in self.items)

    def drop_done(self) -> None:
        """Under the lock: forget the inputs of requests that ended (cancelled, timed out, failed)."""
        self.items = [it for it in self.items if it.job.state is not JobState.DONE]

    def clear(self) -> None:
        self.items.clear()

    def take(self, start: Callable[[Job], None], flush: bool) -> tuple[list[EmbedItem] | None, float | None]:
        """Under the lock: the next batch (its jobs started with `start`), or (None, when to look again) while
        it waits for company; `flush` runs what is queued without waiting."""
        queued = [QueuedInput(len(it.ids), it.job.spec.pooling, it.job.timings.enqueued) for it in self.items]
        picked, wake_at = pick_embed_batch(queued, time.monotonic(), self.max_batch_size, self.max_batch_tokens,
                                           self.max_wait_s, flush=flush)
        if picked is None:
            return None, wake_at
        batch = [self.items[i] for i in picked]
        chosen = set(picked)
        self.items = [it for i, it in enumerate(self.items) if i not in chosen]
        for item in batch:
            start(item.job)
        return batch, None

    def run(self, batch: list[EmbedItem], fail_jobs: Callable[[Iterable[Job]], None]) -> None:
        """One backend call for the batch; each request completes when its last sequence has its vector. Inputs
        of requests whose client left after the batch was taken are left out (the whole call when none stays)."""
        with self.cond:
            batch = [it for it in batch if it.job.state is JobState.RUNNING]
        if not batch:
            return
        longest = max(len(it.ids) for it in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
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
            fail_jobs({id(it.job): it.job for it in batch}.values())
            return
        for item, vector in zip(batch, vectors, strict=True):
            self._deliver(item, vector)

    def _deliver(self, item: EmbedItem, vector: Any) -> None:
        job = item.job
        if job.state is not JobState.RUNNING:
            return
        if job.spec.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        job.vectors[item.index] = vector.tolist()
        job.items_left -= 1
        if job.items_left == 0:
            self.metrics.prompt_tokens.inc(job.spec.total_tokens)  # completed requests only
            with self.cond:
                job.state = JobState.DONE
            job.timings.finished = time.monotonic()
            job.complete()
