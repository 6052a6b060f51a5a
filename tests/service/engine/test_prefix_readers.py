"""Causal prompts that share a long prefix with a prompt being read now wait for its kept state instead of reading
the prefix beside it (service/engine/prefix_readers.py, prompt_reuse.py `_waits_for_reader`): questions about a
new document that arrive together read it once, answer bit for bit as each alone on a server with the prefix
cache off, and a reader that fails or leaves, or a waiter that leaves, changes no answer and leaks no block."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from service.engine.core import Engine
from service.engine.prefix_readers import WAIT_MIN_GAIN, PrefixReaders
from service.engine.prompt_reuse import tail_boundaries
from service.errors import ServiceError

from .test_shared_prefix import (
    BOUNDARY,
    DOC_LEN,
    NEW,
    QUESTIONS,
    Answer,
    _all_back,
    _alone,
    _collect,
    _engine,
    _spec,
    _together,
    _tokens,
)


def _reads(engine: Engine) -> list[tuple[int, int]]:
    """(where each causal read starts, the prompt's length), recorded from the runner's extend."""
    reads: list[tuple[int, int]] = []
    extend = engine.runner.extend_slices

    def recording(prompt: Any, reserve: int, state: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append((state.length if state is not None else 0, len(prompt)))
        return extend(prompt, reserve, state, *args, **kwargs)

    engine.runner.extend_slices = recording  # type: ignore[method-assign]
    return reads


def _waits(engine: Engine) -> float:
    return engine.metrics.prefix_cache.read_waits._value.get()  # type: ignore[attr-defined,union-attr]


def test_questions_about_a_new_document_arriving_together_read_it_once(artifact: Any) -> None:
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS)]
    cold = _alone(artifact, specs)
    engine = _engine(artifact)
    reads = _reads(engine)
    engine.start()
    try:
        warm = _together(engine, specs)
        waits = _waits(engine)
    finally:
        engine.stop()
    assert warm == cold  # the same tokens and logprobs, float for float
    assert waits == 2
    # the first reads the document; the others continue from its state kept at the document's last boundary
    assert sorted(reads) == sorted([(0, DOC_LEN + len(QUESTIONS[0]))]
                                   + [(BOUNDARY, DOC_LEN + len(q)) for q in QUESTIONS[1:]])
    _all_back(engine)


@pytest.mark.parametrize("how", ["fails", "leaves"])
def test_a_reader_that_fails_or_leaves_before_its_state_is_kept_lets_its_waiters_read(artifact: Any, how: str) -> None:
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS[:2])]
    cold = _alone(artifact, specs[1:])
    engine = _engine(artifact)
    reads = _reads(engine)
    reuse = engine.generations.reuse
    reading, first = reuse.reading, []

    def read_slice(job: Any, state: Any) -> None:
        if job.spec is specs[0] and not first:  # after the reader's first slice, before its kept boundary
            first.append(job)
            if how == "fails":
                raise RuntimeError("injected")
            engine.cancel(job)
        reading(job, state)

    reuse.reading = read_slice  # type: ignore[method-assign]

    async def run() -> Answer:
        with engine._cond:
            streams = [engine.generate(spec) for spec in specs]
        later = await _collect(streams[1])
        if how == "fails":
            with pytest.raises(ServiceError):
                await _collect(streams[0])
        return later

    engine.start()
    try:
        warm = asyncio.run(run())
        waits = _waits(engine)
    finally:
        engine.stop()
    assert [warm] == cold
    assert waits == 1
    assert reads[-1] == (0, DOC_LEN + len(QUESTIONS[1]))  # the waiter read everything itself
    _all_back(engine)


def test_a_waiter_whose_client_leaves_is_dropped_and_the_others_answer_as_alone(artifact: Any) -> None:
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS)]
    cold = _alone(artifact, [specs[0], specs[2]])
    engine = _engine(artifact)
    readers = engine.generations.reuse.readers
    assert readers is not None
    wait = readers.wait

    def waiting(reader: Any, job: Any) -> None:
        wait(reader, job)
        if job.spec is specs[1]:
            engine.cancel(job)

    readers.wait = waiting  # type: ignore[method-assign]

    async def run() -> list[Answer]:
        with engine._cond:
            streams = [engine.generate(spec) for spec in specs]
        return [await _collect(streams[0]), await _collect(streams[2])]

    engine.start()
    try:
        warm = asyncio.run(run())
        dropped = engine.metrics.dropped.labels("prefill")._value.get()  # type: ignore[attr-defined]
    finally:
        engine.stop()
    assert warm == cold
    assert dropped == 1 and len(readers) == 0
    _all_back(engine)


# ---- the registry alone ---------------------------------------------------------------------------------


def _job(length: int = 0) -> Any:
    return SimpleNamespace(cache=SimpleNamespace(length=length), cancel_requested=False)


def _links(n: int, tag: str = "doc") -> list[tuple[int, str]]:
    return [(b, f"{tag}{b}") for b in range(256, n + 1, 256)]


def test_a_prompt_waits_only_for_a_gain_worth_the_readers_remaining_read() -> None:
    readers = PrefixReaders()
    reader_job = _job()
    keep = 12_288
    readers.add(reader_job, keep, tail_boundaries(keep), _links(12_500))
    # sharing 10,000 tokens: the reader's last tail at or before them is 8,192 (every 4,096th, and its last four)
    shared = _links(10_000) + [(b, f"q{b}") for b in range(10_240, 12_000, 256)]
    found = readers.reader_for(shared, 0)
    assert found is not None and found.gain(9_984, 0) == 8_192
    assert readers.reader_for(shared, 8_192 - WAIT_MIN_GAIN + 256) is None  # the cache holds nearly as much
    assert readers.reader_for(_links(6_000), 0) is None  # gain 4,096 (the tail at 4,096), 12,288 left: 3x
    reader_job.cache.length = 4_096
    assert readers.reader_for(_links(6_000), 0) is not None  # 8,192 left: 2x
    readers._readers[id(reader_job)].tails = [keep]
    assert readers.reader_for(_links(6_000), 0) is None  # no tail to continue from before 12,288


def test_a_readers_waiters_are_released_when_it_is_done_and_dropped_when_they_leave() -> None:
    readers = PrefixReaders()
    reader_job, waiters = _job(), [_job(), _job(), _job()]
    readers.add(reader_job, 2_048, tail_boundaries(2_048), _links(2_100))
    reader = readers.reader_for(_links(2_048) + [(2_304, "other")], 0)
    assert reader is not None
    for job in waiters:
        readers.wait(reader, job)
    waiters[1].cancel_requested = True
    assert readers.drop_cancelled() == [waiters[1]] and len(readers) == 2
    readers.done(reader_job)
    assert readers.take_released() == [waiters[0], waiters[2]] and len(readers) == 0
    assert readers.reader_for(_links(2_048), 0) is None  # no reader left
    readers.done(reader_job)  # done again: nothing
    assert readers.take_all() == []


def test_jobs_waiting_for_blocks_start_as_many_as_fit_not_all_or_none(artifact: Any) -> None:
    """Waiters released at different turns can need more than the whole cache together while each fits alone:
    the engine starts the longest run from the first that fits now, so none waits forever."""
    probe = _engine(artifact).runner.cache
    one = -(-(DOC_LEN + 50 + NEW) // probe.block_size)
    cache_bytes = (2 * one + 8) * probe.bytes_per_block + 4 * probe.reserved_bytes_per_slot  # room for two
    engine = _engine(artifact, cache_bytes=cache_bytes, max_batch_size=4)
    jobs = [SimpleNamespace(spec=SimpleNamespace(prompt_ids=[3] * (DOC_LEN + 50), max_new_tokens=NEW))
            for _ in range(3)]
    engine.generations.blocked.extend(jobs)  # type: ignore[arg-type]
    with engine._cond:
        assert engine._take_prefills() == jobs[:2]
        assert engine.generations.blocked == jobs[2:]


def test_a_prompt_continued_from_a_kept_state_keeps_its_own_only_far_past_it(artifact: Any) -> None:
    """A kept state is a copy of the whole state: a question that crosses a block boundary or two past the
    document's kept state does not keep another copy (KEEP_MIN_NEW_TOKENS); a prompt 1,024 tokens or more past
    it does."""
    from model.sampling import SamplingParams
    from service.engine.prompt_reuse import KEEP_MIN_NEW_TOKENS
    from service.jobs import GenerationSpec

    doc = _tokens(300, 50)  # kept at 256

    def spec(question: list[int]) -> GenerationSpec:
        return GenerationSpec(prompt_ids=doc + question, sampling=SamplingParams(), max_new_tokens=2,
                              stop_on_eos=False)

    engine = _engine(artifact)
    store = engine.prefix_cache.store  # type: ignore[union-attr]
    engine.start()
    try:
        _together(engine, [spec(_tokens(10, 51))])
        assert len(store) == 1 and store.longest() == 256
        _together(engine, [spec(_tokens(300, 52))])  # its last boundary, 512, lies 256 past the kept 256
        assert len(store) == 1
        _together(engine, [spec(_tokens(KEEP_MIN_NEW_TOKENS + 100, 53))])  # its last boundary: 1,280
        assert len(store) == 2 and store.longest() == 1280
    finally:
        engine.stop()
