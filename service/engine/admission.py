"""Admission: the bounded queue's accounting. A request holds a `Reservation` from its arrival (before its
body is parsed) until it is admitted as a queue entry, refused or answered; admission turns the reservation
into the entry (passed explicitly: the middleware puts it on `request.state.reservation`, the routes hand it
to `Engine.generate`/`Engine.embed`). A queued
request that waits longer than `request_timeout_s` gets 504. The queues themselves belong to the engine;
everything here happens under `cond`, the lock the worker also takes."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from service.engine.jobs_runtime import Job, JobState
from service.errors import Overloaded, QueueTimeout, Unavailable
from service.observability.metrics import ServiceMetrics


class Reservation:
    """A request's place in the queue: held from its arrival until its first sequence is admitted (see
    Admission.reserve), then the queue entry its sequences share (`pending` of them waiting for the model). The
    queue counts requests, not sequences: a request of 17 prompts with n=4 takes one place."""

    __slots__ = ("admitted", "held", "pending")

    def __init__(self) -> None:
        self.held = True
        self.admitted = False
        self.pending = 0


class Admission:
    def __init__(self, max_queue_size: int, request_timeout_s: float, metrics: ServiceMetrics) -> None:
        self.max_queue_size = max_queue_size
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.cond = threading.Condition()
        self.pending = {"embed": 0, "generate": 0}  # requests admitted with a sequence not yet started
        self.reserved = 0  # requests arrived but not yet admitted (touched on the event loop only)
        self.entries: dict[Job, Reservation] = {}  # each pending job's request entry

    def waiting(self) -> int:
        return sum(self.pending.values()) + self.reserved

    def reserve(self) -> Reservation | Overloaded:
        """A place in the queue for a request that has just arrived, or the 429 it gets at once (event loop
        only). The excess of a burst is refused before anything of it is read or parsed, while the requests
        ahead of it are still being parsed: they hold reservations until `admit` turns them into queue
        entries, so the queue's capacity counts them from the moment they arrive."""
        if self.waiting() >= self.max_queue_size:
            return self.overloaded()
        self.reserved += 1
        return Reservation()

    def release(self, reservation: Reservation) -> None:
        """The request was admitted, refused or answered: its reservation no longer holds a place."""
        if reservation.held:
            reservation.held = False
            self.reserved -= 1

    def overloaded(self) -> Overloaded:
        self.metrics.rejected.labels("queue_full").inc()
        return Overloaded(
            f"the queue is full ({self.waiting()} requests waiting, max_queue_size={self.max_queue_size});"
            " retry later",
            headers={"Retry-After": "1"},
        )

    def admit(self, job: Job, enqueue: Callable[[], None], reservation: Reservation | None, closed: Callable[[], bool]
              ) -> None:
        """Queue the job (enqueue runs under the lock), its request's reservation becoming the entry its
        sequences share; 503 when `closed()`, 429 when the queue is full (not counting the job's own
        reservation). A further sequence of a request already admitted is never refused for room: the request
        holds its place (a retry could not do better), and refusing it would make a request within every
        per-request limit depend on how fast the worker drains the queue meanwhile."""
        entry = reservation if reservation is not None else Reservation()
        if reservation is None:
            entry.held = False  # a direct caller (no middleware) held no place before
        own = 1 if entry.held else 0
        with self.cond:
            if closed():
                raise Unavailable("the model worker is not running")
            if not entry.admitted and self.waiting() - own >= self.max_queue_size:
                raise self.overloaded()
            # the timer exists before the worker can see the job: `start` (worker thread, under this lock)
            # cancels it, which it could not do for a timer set after the lock is let go. The timer holds
            # the job weakly all the same: a finished job is not kept for request_timeout_s by its timer.
            # the job counts before the worker can see it, so a worker that starts it at once finds it counted
            if entry.pending == 0:  # the request (again) has a sequence waiting: it counts once
                self.pending[job.kind] += 1
            entry.pending += 1
            self.entries[job] = entry
            job.timer = job.loop.call_later(self.request_timeout_s, self._expire_if_alive, weakref.ref(job))
            try:
                enqueue()
            except BaseException:
                job.timer.cancel()
                self._leave(job)
                raise
            entry.admitted = True
            self.cond.notify()
        self.release(entry)  # the place it held is now the entry's (a fresh entry held none on the loop)

    def _expire_if_alive(self, ref: weakref.ref[Job]) -> None:
        job = ref()
        if job is not None:
            self.expire(job)

    def expire(self, job: Job) -> None:
        with self.cond:
            if job.state is not JobState.PENDING:
                return
            self.finish_pending(job)
        self.metrics.rejected.labels("timeout").inc()
        job.fail(QueueTimeout(
            f"the request waited {self.request_timeout_s:g} s in the queue (request_timeout_s) and was dropped"
        ))

    def finish_pending(self, job: Job) -> None:
        """Under the lock: a pending job leaves the queue without running."""
        job.state = JobState.DONE
        self._leave(job)
        if job.timer is not None:
            job.timer.cancel()

    def _leave(self, job: Job) -> None:
        """Under the lock: a pending job leaves the queue; its request stops counting with its last one."""
        entry = self.entries.pop(job, None)
        if entry is None:
            return
        entry.pending -= 1
        if entry.pending == 0:
            self.pending[job.kind] -= 1

    def start(self, job: Job) -> None:
        """Under the lock: the model starts on a pending job."""
        if job.state is JobState.PENDING:
            self._leave(job)
            job.state = JobState.RUNNING
            job.timings.started = time.monotonic()
            if job.timer is not None:
                job.loop.call_soon_threadsafe(job.timer.cancel)

    def clear(self) -> None:
        """Under the lock: nothing is pending any more (the engine failed or drained every job)."""
        self.pending = {"embed": 0, "generate": 0}
        self.entries.clear()
