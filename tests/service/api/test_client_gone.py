"""Work stops within one slice or step of its client leaving, at every stage of the engine: a sliced prefill
(alone, or a group once all of its jobs have gone), a prefill whose jobs left before it ran, a decode, an
embedding batch taken but not yet run. Each is read from the worker's own calls, with the worker held where
the client leaves (no timed assertions; WAIT_S only guards against a hang)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

import service.engine.generation_steps as steps_module
from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig
from service.jobs import EmbeddingSpec, GenerationSpec
from service.observability.metrics import ServiceMetrics
from tests.service.helpers import metric_value, observed_slices

LONG_PROMPT = [5 + i % 200 for i in range(300)]
OTHER_PROMPT = [6 + i % 200 for i in range(300)]  # as long: prefilled in one group with LONG_PROMPT
WAIT_S = 30.0


def _spec(prompt: list[int], new: int, prompt_logprobs: int | None = None) -> GenerationSpec:
    return GenerationSpec(prompt_ids=prompt, sampling=SamplingParams(), max_new_tokens=new, stop_on_eos=False,
                          prompt_logprobs=prompt_logprobs)


def _engine(artifact: Any, started: list[Engine], backend: Any = None, **config: Any) -> Engine:
    engine = Engine(artifact.model, artifact.tokenizer, backend=backend, device=None,  # type: ignore[arg-type]
                    config=EngineConfig(warmup=False, **config), metrics=ServiceMetrics())
    started.append(engine)
    return engine


def _dropped(engine: Engine, stage: str) -> float:
    from prometheus_client import generate_latest

    text = generate_latest(engine.metrics.registry).decode()
    return metric_value(text, "reformer_requests_dropped_total", {"stage": stage})


def _wait_idle(engine: Engine) -> None:
    """Until nothing runs, prefills or waits (a guard against a hang, not a measurement)."""
    async def poll() -> None:
        for _ in range(int(WAIT_S / 0.01)):
            with engine._cond:
                if not engine.generations.busy and not engine._gen_queue:
                    return
            await asyncio.sleep(0.01)
        raise AssertionError("the engine never went idle")
    asyncio.run(poll())


def _count_slices(engine: Engine, on_slice: Callable[[int], None]) -> list[int]:
    slices = [0]
    real = engine.runner.prefill_slices

    def after() -> None:
        slices[0] += 1
        on_slice(slices[0])

    real_scored = engine.runner.prefill_scored_slices
    engine.runner.prefill_slices = lambda p, r: observed_slices(real(p, r), after)  # type: ignore[method-assign]
    engine.runner.prefill_scored_slices = (  # type: ignore[method-assign]
        lambda p, r, k: observed_slices(real_scored(p, r, k), after))
    return slices


@pytest.mark.parametrize("scored", [None, 0])  # a plain prefill, and one that scores the prompt
@pytest.mark.parametrize("budget_ms", [0.0, 10_000.0])
def test_a_sliced_prefill_stops_within_one_slice_of_its_client_leaving(
        artifact: Any, started: list[Engine], monkeypatch: pytest.MonkeyPatch, budget_ms: float,
        scored: int | None) -> None:
    # a budget of 10 s: without the check between slices, the whole prefill would run in the first turn
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    engine = _engine(artifact, started, prefill_budget_ms=budget_ms)
    box: list[Any] = []
    slices = _count_slices(engine, lambda n: engine.cancel(box[0].job) if n == 1 else None)
    engine.start()

    async def scenario() -> None:
        box.append(engine.generate(_spec(LONG_PROMPT, 50, scored)))
        with pytest.raises(asyncio.TimeoutError):  # no token comes: the job was dropped
            await asyncio.wait_for(box[0].job.events.get(), 0.5)

    asyncio.run(scenario())
    _wait_idle(engine)
    assert slices[0] == 1
    assert _dropped(engine, "prefill") == 1
    assert engine.runner.stats()["cache_bytes"] == 0


def test_a_prefill_group_stops_once_all_of_its_jobs_left_and_runs_on_for_one_that_stays(
        artifact: Any, started: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    engine = _engine(artifact, started, prefill_budget_ms=0.0)
    streams: list[Any] = []
    gate = threading.Event()

    def on_slice(n: int) -> None:
        if n == 1:
            engine.cancel(streams[0].job)  # one of the group leaves: the group goes on for the other
        if n == 2:
            engine.cancel(streams[1].job)  # then the other: the group stops
        gate.set()

    slices = _count_slices(engine, on_slice)
    engine.start()

    async def scenario() -> None:
        with engine._cond:  # both queued before the worker looks: they start as one group
            streams.extend(engine.generate(_spec(prompt, 20)) for prompt in (LONG_PROMPT, OTHER_PROMPT))
        await asyncio.sleep(1.0)

    asyncio.run(scenario())
    _wait_idle(engine)
    assert slices[0] == 2
    assert _dropped(engine, "prefill") == 2
    assert engine.runner.stats()["cache_bytes"] == 0


def test_a_decode_stops_within_one_step_and_a_gone_member_of_a_group_gets_no_token(
        artifact: Any, started: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    engine = _engine(artifact, started, prefill_budget_ms=0.0)
    streams: list[Any] = []
    slices = _count_slices(engine, lambda n: engine.cancel(streams[0].job) if n == 1 else None)
    steps = [0]
    real_decode = engine.runner.decode

    def decode(tokens: Any, states: Any) -> Any:
        steps[0] += 1
        if steps[0] == 2:
            engine.cancel(streams[1].job)
        return real_decode(tokens, states)

    engine.runner.decode = decode  # type: ignore[method-assign]
    engine.start()

    async def scenario() -> None:
        with engine._cond:
            streams.extend(engine.generate(_spec(prompt, 200)) for prompt in (LONG_PROMPT, OTHER_PROMPT))
        await asyncio.sleep(1.0)

    asyncio.run(scenario())
    _wait_idle(engine)
    assert slices[0] > 1  # the group ran on for the job that stayed
    assert streams[0].job.generated == []  # the one that left during the prefill got no token
    assert steps[0] == 2 and len(streams[1].job.generated) == 3  # first token, then two steps
    assert _dropped(engine, "prefill") == 1 and _dropped(engine, "decode") == 1
    assert engine.runner.stats()["cache_bytes"] == 0


@pytest.mark.parametrize("fork_stays", [True, False])
def test_a_prefill_runs_on_for_a_fork_waiting_on_it_and_stops_when_the_fork_left_too(
        artifact: Any, started: list[Engine], monkeypatch: pytest.MonkeyPatch, fork_stays: bool) -> None:
    """Two requests of the same prompt: the second is a fork waiting for the first's prefill
    (service/engine/prompt_reuse.py). The first leaving does not stop the prefill the fork needs."""
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    engine = _engine(artifact, started, prefill_budget_ms=0.0)
    streams: list[Any] = []

    def on_slice(n: int) -> None:
        if n == 1:
            engine.cancel(streams[0].job)
        if n == 2 and not fork_stays:
            engine.cancel(streams[1].job)

    slices = _count_slices(engine, on_slice)
    engine.start()

    async def scenario() -> list[int]:
        with engine._cond:
            streams.extend(engine.generate(_spec(LONG_PROMPT, 5)) for _ in range(2))
        ids: list[int] = []
        if fork_stays:
            while True:
                event = await asyncio.wait_for(streams[1].next_event(), WAIT_S)
                ids.append(event.id)
                if event.finish is not None:
                    return ids
        await asyncio.sleep(1.0)
        return ids

    fork_ids = asyncio.run(scenario())
    _wait_idle(engine)
    assert streams[0].job.generated == []
    if fork_stays:
        assert len(fork_ids) == 5 and slices[0] > 2
        assert _dropped(engine, "prefill") == 1
    else:
        assert slices[0] == 2 and streams[1].job.generated == []
        assert _dropped(engine, "prefill") == 2
    assert engine.runner.stats()["cache_bytes"] == 0


def test_a_prompt_whose_prefill_was_dropped_is_prefilled_again_for_the_next_request(
        artifact: Any, started: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request leaves mid-prefill and its prefill stops; the same prompt asked again must lead a new
    prefill, not wait as a fork of the one that stopped."""
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    engine = _engine(artifact, started, prefill_budget_ms=0.0)
    box: list[Any] = []
    _count_slices(engine, lambda n: engine.cancel(box[0].job) if n == 1 else None)
    engine.start()

    async def scenario() -> int:
        box.append(engine.generate(_spec(LONG_PROMPT, 3)))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(box[0].job.events.get(), 0.5)
        again = engine.generate(_spec(LONG_PROMPT, 3))
        count = 0
        while True:
            event = await asyncio.wait_for(again.next_event(), WAIT_S)
            count += 1
            if event.finish is not None:
                return count

    assert asyncio.run(scenario()) == 3
    _wait_idle(engine)
    assert engine.runner.stats()["cache_bytes"] == 0


class _HeldBackend:
    """An embedding backend that counts its calls; the first waits until `release` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls, self.rows = inner, 0, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def embed(self, ids: Any, mask: Any, pooling: Any) -> Any:
        self.calls += 1
        self.rows += int(ids.shape[0])
        if self.calls == 1:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return self.inner.embed(ids, mask, pooling)


def test_an_embedding_request_that_left_runs_no_further_batch(artifact: Any, started: list[Engine]) -> None:
    import torch

    from service.engine.backends import TorchBackend

    backend = _HeldBackend(TorchBackend(artifact.model, torch.device("cpu")))
    engine = _engine(artifact, started, backend=backend, max_batch_size=2, max_wait_ms=0.0)
    engine.start()

    async def scenario() -> None:
        spec = EmbeddingSpec(sequences=[[5, 6, 7]] * 6)  # three batches of two
        task = asyncio.create_task(engine.embed(spec))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, backend.entered.wait, WAIT_S)
        task.cancel()  # the client leaves during the first batch
        with pytest.raises(asyncio.CancelledError):
            await task
        backend.release.set()
        await asyncio.sleep(0.3)

    asyncio.run(scenario())
    assert backend.calls == 1 and backend.rows == 2
    assert _dropped(engine, "embed") == 1


def test_an_embedding_batch_whose_clients_left_after_it_was_taken_does_not_run(
        artifact: Any, started: list[Engine]) -> None:
    import torch

    from service.engine.backends import TorchBackend

    backend = _HeldBackend(TorchBackend(artifact.model, torch.device("cpu")))
    backend.release.set()
    engine = _engine(artifact, started, backend=backend, max_wait_ms=0.0)
    jobs: list[Any] = []
    real_take = engine.embeds.take

    def take(start: Any, flush: bool) -> Any:
        batch, wake_at = real_take(start, flush)
        if batch is not None:
            engine.cancel(batch[0].job)  # the client leaves between the batch's pick and its run
            jobs.append(batch[0].job)
        return batch, wake_at

    engine.embeds.take = take  # type: ignore[method-assign]
    engine.start()

    async def scenario() -> None:
        task = asyncio.create_task(engine.embed(EmbeddingSpec(sequences=[[5, 6, 7]])))
        for _ in range(int(WAIT_S / 0.01)):
            if jobs:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(scenario())
    assert jobs and backend.calls == 0
    assert _dropped(engine, "embed") == 1
