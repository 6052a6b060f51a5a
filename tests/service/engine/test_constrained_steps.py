"""Structured output in the engine's steps: a constrained generation among unconstrained ones takes only allowed
tokens and ends when its constraint does, its batch-mates are untouched, each mask is counted in its timings,
and the decode span carries them."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig
from service.jobs import FinishEvent, GenerationSpec, Timings
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import job_spans
from service.text.structured import ConstraintSource, GrammarCompiler


@pytest.fixture
def engine(artifact: Any) -> Iterator[Engine]:
    e = Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
               config=EngineConfig(warmup=False, max_wait_ms=20), metrics=ServiceMetrics())
    e.start()
    yield e
    e.stop()


def run(engine: Engine, *specs: GenerationSpec) -> list[tuple[FinishEvent, Timings]]:
    async def one(spec: GenerationSpec) -> tuple[FinishEvent, Timings]:
        stream = engine.generate(spec)
        while True:
            event = await stream.next_event()
            if event.finish is not None:
                return event.finish, stream.timings

    async def every() -> list[tuple[FinishEvent, Timings]]:
        return list(await asyncio.gather(*(one(s) for s in specs)))

    return asyncio.run(every())


def test_a_constrained_row_among_others_keeps_to_its_grammar(engine: Engine, artifact: Any) -> None:
    grammar = GrammarCompiler(artifact.tokenizer).compile_now(ConstraintSource("regex", "[ab]{5}", "r"))
    prompt = artifact.tokenizer.encode("Once upon a time")
    plain = GenerationSpec(prompt, SamplingParams(), 12, stop_on_eos=False)
    constrained = GenerationSpec(prompt, SamplingParams(do_sample=True, seed=3), 12, constraint=grammar)
    alone_plain = run(engine, plain)[0][0]
    (mixed_plain, plain_timings), (finish, timings) = run(engine, plain, constrained)
    assert re.fullmatch("[ab]{5}", finish.generated_text) and finish.finish_reason == "eos_token"
    assert len(finish.generated_ids) == 5  # ended by its grammar, not by its budget of 12
    assert mixed_plain.generated_ids == alone_plain.generated_ids  # the unconstrained row is not masked
    assert (timings.mask_steps, plain_timings.mask_steps) == (5, 0)  # the prefill's first token and 4 steps
    assert timings.mask_s > 0 and engine.metrics.structured.mask_time._sum.get() > 0  # type: ignore[attr-defined]
    assert run(engine, constrained)[0][0].generated_text == finish.generated_text  # alone: the same text


def test_the_decode_span_carries_the_mask_time() -> None:
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for steps in (0, 7):
        memory.clear()
        job = Timings(enqueued=1.0, admitted=1.0, started=1.0, first_token=2.0, finished=3.0)
        job.prefill.tokens = 4
        job.prefill.add_slice(1.0, 2.0)
        job.mask_s, job.mask_steps = 0.000125 * steps, steps
        job_spans(tracer, tracer.start_span("request"), job, response_end=3.0, offset_ns=0)
        (decode,) = [s for s in memory.get_finished_spans() if s.name == "decode"]
        expected = {"reformer.structured.mask_s": 0.000875, "reformer.structured.mask_steps": 7} if steps else {}
        assert dict(decode.attributes or {}) == expected
