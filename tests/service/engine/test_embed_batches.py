"""The embedding side of the worker loop without a model or a thread: a request's sequences are batched,
each request completes with its vectors in order, and a failing backend call fails only its own batch."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from service.engine.embed_batches import EmbedBatches
from service.engine.jobs_runtime import EmbedJob, Job, JobState
from service.jobs import EmbeddingSpec
from service.observability.metrics import ServiceMetrics


class _Backend:
    """Each row's vector is (its real-token count, its pooling's length); fails on a row of token 99."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def embed(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
        self.calls.append(ids.shape[0])
        if (ids == 99).any():
            raise RuntimeError("injected")
        return torch.stack([mask.sum(1).float(), torch.full((ids.shape[0],), float(len(pooling)))], dim=1)


def _batches(backend: Any, max_batch_size: int = 8) -> EmbedBatches:
    return EmbedBatches(backend, 0, ServiceMetrics(), threading.Condition(), max_batch_size, 4096, 0.0)


def _start(job: Job) -> None:
    job.state = JobState.RUNNING


def test_a_requests_sequences_run_together_and_complete_it_in_order() -> None:
    async def go() -> list[list[float]]:
        backend = _Backend()
        batches = _batches(backend)
        job = EmbedJob(EmbeddingSpec([[5, 6, 7], [8], [9, 10]], normalize=False), asyncio.get_running_loop(), None)
        batches.enqueue(job)
        batch, _ = batches.take(_start, flush=True)
        assert batch is not None and len(batch) == 3 and batches.items == []
        batches.run(batch, lambda jobs: pytest.fail("nothing fails"))
        assert backend.calls == [3] and job.state is JobState.DONE
        return (await job.future).vectors

    assert asyncio.run(go()) == [[3.0, 4.0], [1.0, 4.0], [2.0, 4.0]]


def test_a_failing_batch_fails_its_requests_alone() -> None:
    async def go() -> None:
        backend = _Backend()
        batches = _batches(backend, max_batch_size=1)
        loop = asyncio.get_running_loop()
        bad = EmbedJob(EmbeddingSpec([[99, 5]]), loop, None)
        good = EmbedJob(EmbeddingSpec([[5, 6]]), loop, None)
        batches.enqueue(bad)
        batches.enqueue(good)
        failed: list[Job] = []
        for _ in range(2):
            batch, _ = batches.take(_start, flush=True)
            assert batch is not None and len(batch) == 1
            batches.run(batch, failed.extend)
        assert failed == [bad] and good.state is JobState.DONE
        assert len((await good.future).vectors) == 1

    asyncio.run(go())


def test_inputs_of_ended_requests_leave_the_queue() -> None:
    async def go() -> None:
        batches = _batches(_Backend())
        job = EmbedJob(EmbeddingSpec([[5], [6]]), asyncio.get_running_loop(), None)
        batches.enqueue(job)
        assert list(batches.jobs()) == [job, job]
        job.state = JobState.DONE  # cancelled or timed out
        batches.drop_done()
        assert batches.items == [] and batches.take(_start, flush=True) == (None, None)

    asyncio.run(go())
