"""Admission alone: reservations count against the queue and are handed over explicitly."""

from __future__ import annotations

import asyncio

import pytest

from service.admission import Admission, Reservation
from service.errors import Overloaded, Unavailable
from service.jobs_runtime import Job, JobState
from service.metrics import ServiceMetrics


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
