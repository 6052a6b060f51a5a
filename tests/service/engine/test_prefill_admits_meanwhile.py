"""A long prompt that starts while nothing else runs is still prefilled in slices: a short request that arrives
during that prefill is admitted between its slices and gets its first token before the long prompt's prefill
ends. The order is read from the worker's own calls, with the worker held after the first slice until the short
request is queued (no timed assertions)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import service.engine.generation_steps as steps_module
from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig
from service.jobs import GenerationSpec
from service.observability.metrics import ServiceMetrics
from tests.service.helpers import observed_slices

LONG_PROMPT = [5 + i % 200 for i in range(300)]
SHORT_PROMPT = [5, 6, 7]
# a guard against a hang if the worker never reaches its first slice, not a measurement
WAIT_S = 30.0


def _spec(prompt: list[int], new: int) -> GenerationSpec:
    return GenerationSpec(prompt_ids=prompt, sampling=SamplingParams(), max_new_tokens=new, stop_on_eos=False)


async def _collect(engine: Engine, spec: GenerationSpec) -> list[int]:
    stream = engine.generate(spec)
    ids: list[int] = []
    while True:
        event = await stream.next_event()
        ids.append(event.id)
        if event.finish is not None:
            return ids


def _engine(artifact: Any, started: list[Engine]) -> Engine:
    config = EngineConfig(warmup=False, prefill_budget_ms=0.0)
    engine = Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                    config=config, metrics=ServiceMetrics())
    started.append(engine)
    return engine


def _record(engine: Engine, first_slice: threading.Event, short_queued: threading.Event) -> list[str]:
    """The worker's calls in order: "s" a slice of a sliced prefill, "p" a prefill in one piece, "d" a decode
    step, "first:N" the first token of the request whose prompt has N tokens. The worker waits after the
    first slice until `short_queued`."""
    calls: list[str] = []
    real_slices, real_prefill, real_decode = engine.runner.prefill_slices, engine.runner.prefill, engine.runner.decode
    real_prefilled = engine.generations._prefilled

    def after_slice() -> None:
        calls.append("s")
        if not first_slice.is_set():
            first_slice.set()
            assert short_queued.wait(WAIT_S), "the short request was never queued"

    def prefill_slices(prompts: Any, reserve: Any) -> Any:
        return observed_slices(real_slices(prompts, reserve), after_slice)

    def prefill(prompts: Any, reserve: Any) -> Any:
        calls.append("p")
        return real_prefill(prompts, reserve)

    def decode(tokens: Any, states: Any) -> Any:
        calls.append("d")
        return real_decode(tokens, states)

    def prefilled(jobs: Any, logits: Any, states: Any, scores: Any = None) -> None:
        calls.extend(f"first:{len(job.spec.prompt_ids)}" for job in jobs)
        real_prefilled(jobs, logits, states, scores)

    engine.runner.prefill_slices = prefill_slices  # type: ignore[method-assign]
    engine.runner.prefill = prefill  # type: ignore[method-assign]
    engine.runner.decode = decode  # type: ignore[method-assign]
    engine.generations._prefilled = prefilled  # type: ignore[method-assign]
    return calls


def test_a_request_arriving_during_a_lone_long_prefill_gets_its_first_token_before_that_prefill_ends(
        artifact: Any, started: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    alone_engine = _engine(artifact, started)
    alone_engine.start()
    long_alone, short_alone = (asyncio.run(_collect(alone_engine, _spec(p, n)))
                               for p, n in ((LONG_PROMPT, 4), (SHORT_PROMPT, 5)))

    engine = _engine(artifact, started)  # a fresh engine: nothing has run before the long prompt
    first_slice, short_queued = threading.Event(), threading.Event()
    calls = _record(engine, first_slice, short_queued)
    engine.start()

    async def scenario() -> tuple[list[int], list[int]]:
        long = asyncio.create_task(_collect(engine, _spec(LONG_PROMPT, 4)))
        sliced = await asyncio.get_running_loop().run_in_executor(None, first_slice.wait, WAIT_S)
        assert sliced, "the long prompt, alone, was not prefilled in slices"
        short = asyncio.create_task(_collect(engine, _spec(SHORT_PROMPT, 5)))
        await asyncio.sleep(0)  # the task runs up to its first await: the request is queued
        short_queued.set()
        return await long, await short

    long_out, short_out = asyncio.run(scenario())
    assert long_out == long_alone and short_out == short_alone  # slicing and company change no token
    assert calls[0] == "s"  # the long prompt, alone, started sliced
    last_slice = len(calls) - 1 - calls[::-1].index("s")
    short_first = calls.index(f"first:{len(SHORT_PROMPT)}")
    assert short_first < last_slice  # its first token came before the long prefill's last slice
    assert "d" in calls[short_first:last_slice]  # and it decoded between the slices
    assert calls.index(f"first:{len(LONG_PROMPT)}") > last_slice
