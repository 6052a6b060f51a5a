"""Admission alone: reservations count against the queue and are handed over explicitly."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from service.engine.admission import Admission, Reservation
from service.engine.jobs_runtime import Job, JobState
from service.errors import Overloaded, QueueTimeout, Unavailable
from service.observability.metrics import ServiceMetrics


def test_an_explicit_reservation_becomes_the_queue_entry() -> None:
    async def scenario() -> None:
        adm = Admission(max_queue_size=2, request_timeout_s=30, metrics=ServiceMetrics())
        first, second = adm.reserve(), adm.reserve()
        assert isinstance(first, Reservation) and isinstance(second, Reservation)
        assert isinstance(adm.reserve(), Overloaded)  # two places held by requests still being parsed
        queue: list[Job] = []
        job = Job(asyncio.get_running_loop(), None)
        job.kind = "generate"
        adm.admit(job, lambda: queue.append(job), first, closed=lambda: False)
        assert queue == [job] and not first.held and adm.waiting() == 2
        with pytest.raises(Overloaded):  # a request without a reservation finds no place
            adm.admit(Job(asyncio.get_running_loop(), None), lambda: None, None, closed=lambda: False)
        adm.release(second)
        with pytest.raises(Unavailable):
            adm.admit(Job(asyncio.get_running_loop(), None), lambda: None, None, closed=lambda: True)
        with adm.cond:
            adm.start(job)
        assert job.state is JobState.RUNNING and adm.waiting() == 0

    asyncio.run(scenario())


def test_a_job_the_worker_starts_at_once_leaves_no_timer_holding_it() -> None:
    """The worker may start a job the moment it is queued, before `admit` returns: its queue timer must be
    cancelled all the same, and nothing of admission keeps the finished job alive."""
    async def scenario() -> None:
        adm = Admission(max_queue_size=2, request_timeout_s=3600, metrics=ServiceMetrics())
        job = Job(asyncio.get_running_loop(), None)
        job.kind = "generate"
        queue = [job]

        def enqueue_and_start() -> None:  # what a worker taking the job at once does, under the lock
            with adm.cond:
                adm.start(queue.pop())

        adm.admit(job, enqueue_and_start, None, closed=lambda: False)
        await asyncio.sleep(0)  # the cancel `start` posts to the loop runs
        timer = job.timer
        assert timer is not None and timer.cancelled()
        job.state = JobState.DONE
        alive = weakref.ref(job)
        del job
        gc.collect()
        assert alive() is None  # not held by the loop's timer heap for the hour of request_timeout_s

    asyncio.run(scenario())


def test_a_queued_job_still_expires_through_its_weak_timer() -> None:
    async def scenario() -> None:
        adm = Admission(max_queue_size=2, request_timeout_s=0.01, metrics=ServiceMetrics())
        failed: list[Exception] = []
        job = Job(asyncio.get_running_loop(), None)
        job.kind = "generate"
        job.fail = failed.append  # type: ignore[method-assign]
        adm.admit(job, lambda: None, None, closed=lambda: False)
        await asyncio.sleep(0.1)
        assert job.state is JobState.DONE and adm.waiting() == 0
        assert len(failed) == 1 and isinstance(failed[0], QueueTimeout)

    asyncio.run(scenario())


def test_the_queue_counts_requests_not_sequences() -> None:
    """A request of many sequences (17 prompts, n=4) takes one place, and none of its sequences is refused
    for room once the request is admitted, whatever the worker has started meanwhile."""
    async def scenario() -> None:
        adm = Admission(max_queue_size=2, request_timeout_s=30, metrics=ServiceMetrics())
        big, other = adm.reserve(), adm.reserve()
        assert isinstance(big, Reservation) and isinstance(other, Reservation)
        jobs = []
        for i in range(68):
            job = Job(asyncio.get_running_loop(), None)
            job.kind = "generate"
            adm.admit(job, lambda: None, big, closed=lambda: False)
            jobs.append(job)
            if i == 10:  # the worker starts a few meanwhile
                with adm.cond:
                    for started in jobs[:5]:
                        adm.start(started)
        assert adm.pending["generate"] == 1 and adm.waiting() == 2  # the big request and the one being parsed
        assert isinstance(adm.reserve(), Overloaded)  # a third request finds the two places taken
        with adm.cond:
            for job in jobs[5:]:
                adm.start(job)
        assert adm.pending["generate"] == 0 and adm.waiting() == 1

    asyncio.run(scenario())
