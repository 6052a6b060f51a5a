"""Delivery from the worker thread to the event loop: one hand-off per loop for a whole decode step, every
request's events in order; a non-streaming request's tokens held until its last."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from model.sampling import SamplingParams
from service.engine.jobs_runtime import GenerationJob, deliver_together
from service.jobs import FinishEvent, GenerationSpec, TokenEvent


def _event(i: int, last: bool = False) -> TokenEvent:
    finish = FinishEvent(finish_reason="length", generated_ids=[], generated_text="", prompt_tokens=1,
                         seed=None) if last else None
    return TokenEvent(i, 5 + i, "x", -0.5, False, finish)  # token id 5 + i


def _job(loop: asyncio.AbstractEventLoop, tokenizer: Any, stream: bool = True) -> GenerationJob:
    return GenerationJob(GenerationSpec([5], SamplingParams(), 3), loop, None, tokenizer, stream)


def test_a_step_hands_its_events_to_each_loop_once_and_in_order(artifact: Any) -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        calls: list[int] = []
        real = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            calls.append(1)
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        a, b = _job(loop, artifact.tokenizer), _job(loop, artifact.tokenizer)
        worker = threading.Thread(target=deliver_together,
                                  args=([(a, _event(0)), (b, _event(0)), (a, _event(1))],))
        worker.start()
        worker.join()
        assert len(calls) == 1  # one wake-up of the loop for the whole step
        got_a = [await a.events.get(), await a.events.get()]
        assert [e.id for e in got_a] == [5, 6] and (await b.events.get()).id == 5  # type: ignore[union-attr]

    asyncio.run(go())


def test_a_non_streaming_job_holds_its_tokens_until_the_last(artifact: Any) -> None:
    async def go() -> None:
        job = _job(asyncio.get_running_loop(), artifact.tokenizer, stream=False)
        assert job.to_deliver(_event(0)) == [] and job.to_deliver(_event(1)) == []
        held = job.to_deliver(_event(2, last=True))
        assert [e.id for e in held] == [5, 6, 7] and job.held == []
        streaming = _job(asyncio.get_running_loop(), artifact.tokenizer)
        assert [e.id for e in streaming.to_deliver(_event(0))] == [5]

    asyncio.run(go())
