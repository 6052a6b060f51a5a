"""Causal prompts that continue from a kept state of a document share its blocks with a running request that holds
the same document (service/engine/live_prefixes.py, prompt_reuse.py `_continue_causal`, DecodeCache.share_prefix):
several questions about one document running at once hold it once, are admitted for their own part, answer
bit for bit what each answers alone on a server with an empty cache (the same tokens and logprobs), and a holder
that leaves midway changes nothing for them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig
from service.engine.jobs_runtime import JobState
from service.jobs import GenerationSpec
from service.observability.metrics import ServiceMetrics
from service.prefix_cache import PrefixCacheConfig

from .test_shared_forks import _peak_blocks

DOC_LEN, NEW = 1400, 6
BOUNDARY = DOC_LEN // 256 * 256  # the document's last whole block boundary: 1,280


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOC = _tokens(DOC_LEN, 21)
QUESTIONS = [_tokens(n, 22 + i) for i, n in enumerate((20, 35, 50))]
LONG_QUESTION = _tokens(400, 30)  # the prompt's kept boundary (1,792) lies past the document


def _spec(question: list[int], seed: int, new: int = NEW) -> GenerationSpec:
    return GenerationSpec(prompt_ids=DOC + question, sampling=SamplingParams(do_sample=True, seed=seed),
                          max_new_tokens=new, stop_on_eos=False)


def _engine(artifact: Any, cache: bool = True, **config: Any) -> Engine:
    prefix = PrefixCacheConfig(capacity_bytes=256 * 2**20, min_tokens=16) if cache else None
    engine = Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                    config=EngineConfig(warmup=False, prefill="causal", prefix_cache=prefix, **config),
                    metrics=ServiceMetrics())
    assert engine.causal_prefill
    return engine


Answer = tuple[list[int], list[float]]


async def _collect(stream: Any, first: asyncio.Event | None = None) -> Answer:
    ids: list[int] = []
    logprobs: list[float] = []
    while True:
        event = await stream.next_event()
        ids.append(event.id)
        logprobs.append(event.logprob)
        if first is not None:
            first.set()
        if event.finish is not None:
            return ids, logprobs


def _together(engine: Engine, specs: list[GenerationSpec], leaves: int | None = None) -> list[Answer | None]:
    """The specs admitted in one turn (queued under the engine's lock); `leaves`: that one's client goes away once
    the next one's first token is out (its answer None)."""
    async def run() -> list[Answer | None]:
        with engine._cond:
            streams = [engine.generate(spec) for spec in specs]
        first = asyncio.Event()
        tasks = [None if i == leaves else
                 asyncio.ensure_future(_collect(s, first if leaves is not None and i == leaves + 1 else None))
                 for i, s in enumerate(streams)]
        if leaves is not None:
            await first.wait()
            streams[leaves].cancel()
        answers = [None if t is None else await t for t in tasks]
        while leaves is not None and streams[leaves].job.state is not JobState.DONE:
            await asyncio.sleep(0.01)  # dropped at the worker's next turn
        return answers

    return asyncio.run(run())


def _alone(artifact: Any, specs: list[GenerationSpec]) -> list[Answer]:
    """Each spec alone on a causal server with the prefix cache off."""
    engine = _engine(artifact, cache=False)
    engine.start()
    try:
        return [_together(engine, [spec])[0] for spec in specs]  # type: ignore[misc]
    finally:
        engine.stop()


def _shared_metric(engine: Engine) -> float:
    return engine.metrics.prefix_cache.shared_blocks._value.get()  # type: ignore[attr-defined,union-attr]


def _all_back(engine: Engine) -> None:
    cache = engine.runner.cache
    assert cache.allocated_bytes == 0 and all(cache.refs(b) == 0 for b in range(cache.blocks))
    assert cache.free_blocks == cache.blocks - 1 and cache.free_spare_orders == cache.blocks - 1


@pytest.mark.parametrize("kept", ["document", "past-it"])
def test_questions_on_one_document_hold_it_once_and_answer_as_alone(artifact: Any, kept: str) -> None:
    """A first question leaves the document's state in the prefix cache (at its last boundary, or at a boundary
    past it: the others then cut it back), and its blocks of the document behind in the decode cache when it
    finishes (a kept prefix). Three more questions start together: the first shares the kept prefix's blocks of
    the document, the other two the first's."""
    first = _spec(LONG_QUESTION if kept == "past-it" else QUESTIONS[0], seed=1)
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS)]
    cold = _alone(artifact, specs)
    peaks = {}
    for share in (True, False):
        engine = _engine(artifact, shared_blocks=share)
        cache = engine.runner.cache
        engine.start()
        try:
            _together(engine, [first])
            peak = _peak_blocks(cache)  # from here on: the three questions
            warm = _together(engine, specs)
            shared = _shared_metric(engine)
        finally:
            engine.stop()
        assert warm == cold  # the same tokens and the same logprobs, float for float
        k = cache.shared_blocks(BOUNDARY)
        full = sum(-(-(len(s.prompt_ids) + NEW) // cache.block_size) for s in specs)
        assert peak[0] == (full - 2 * k if share else full)
        assert shared == (3 * k if share else 0)
        peaks[share] = peak[0]
        _all_back(engine)
    assert peaks[True] < 0.45 * peaks[False]  # the document held once instead of three times


def test_a_holder_that_leaves_midway_changes_nothing_for_its_sharers(artifact: Any) -> None:
    """The holder restores the document and goes on reading a long question while two others share its document
    blocks; its client leaves after their first token. Their answers are those alone, and every block comes
    back."""
    holder = _spec(LONG_QUESTION, seed=1, new=200)
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS[:2])]
    cold = _alone(artifact, specs)
    engine = _engine(artifact)
    cache = engine.runner.cache
    engine.start()
    try:
        _together(engine, [_spec(QUESTIONS[2], seed=9)])  # keeps the document's state
        warm = _together(engine, [holder, *specs], leaves=0)
        shared = _shared_metric(engine)
        dropped = sum(engine.metrics.dropped.labels(stage)._value.get()  # type: ignore[attr-defined]
                      for stage in ("prefill", "decode"))
    finally:
        engine.stop()
    assert warm[1:] == cold
    assert shared == 3 * cache.shared_blocks(BOUNDARY)  # the holder shares the kept prefix
    assert dropped == 1
    _all_back(engine)


def test_admission_counts_a_sharers_own_part(artifact: Any) -> None:
    """A decode cache with room for about two copies of a question: three start together only because two of
    them share the document's blocks."""
    probe = _engine(artifact).runner.cache
    one = -(-(DOC_LEN + 50 + NEW) // probe.block_size)
    cache_bytes = (2 * one + 8) * probe.bytes_per_block + 4 * probe.reserved_bytes_per_slot
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS)]
    engine = _engine(artifact, cache_bytes=cache_bytes, max_batch_size=4)
    starts: list[int] = []
    take = engine._take_prefills

    def taking() -> Any:
        taken = take()
        if taken:
            starts.append(len(taken))
        return taken

    engine._take_prefills = taking  # type: ignore[method-assign]
    engine.start()
    try:
        _together(engine, [_spec(QUESTIONS[0], seed=9)])
        warm = _together(engine, specs)
    finally:
        engine.stop()
    assert starts == [1, 3]
    assert warm == _alone(artifact, specs)
    _all_back(engine)


@pytest.mark.parametrize("same_salt,scored", [(True, False), (False, False), (True, True)])
def test_a_running_request_is_a_holder_for_its_own_salt_only(artifact: Any, same_salt: bool, scored: bool) -> None:
    """A request read from nothing, still generating, holds the document (a scored one too: its bits are an
    unscored read's): a later question of the same salt continues from the state it kept and shares its blocks;
    one of another salt continues from its own salt's kept state and shares the blocks that salt's finished
    request left behind (a kept prefix), never the running request's."""
    import dataclasses

    first = dataclasses.replace(_spec(QUESTIONS[0], seed=1, new=200), cache_salt="a",
                                prompt_logprobs=1 if scored else None)
    later = dataclasses.replace(_spec(QUESTIONS[1], seed=2), cache_salt="a" if same_salt else "b")
    cold = _alone(artifact, [later])
    engine = _engine(artifact)
    engine.start()
    try:
        if not same_salt:  # the other salt's own kept state of the document
            _together(engine, [dataclasses.replace(_spec(QUESTIONS[2], seed=3), cache_salt="b")])

        restored: list[list[int]] = []  # the blocks of each state a hit restores into, as allocated
        allocate_sharing = engine.generations.reuse._allocate_sharing

        def recording(*args: Any) -> Any:
            state = allocate_sharing(*args)
            restored.append(list(state.blocks))
            return state

        engine.generations.reuse._allocate_sharing = recording  # type: ignore[method-assign]

        async def run() -> Answer:
            holder = engine.generate(first)
            await holder.next_event()  # read and kept, now generating
            held = list(holder.job.cache.blocks)  # it runs for 200 tokens: still its state
            answer = await _collect(engine.generate(later))
            k = engine.runner.cache.shared_blocks(BOUNDARY)
            assert len(set(restored[-1][:k]) & set(held[:k])) == (k if same_salt else 0)
            assert holder.job.state is JobState.RUNNING  # still holding the document
            holder.cancel()
            return answer

        warm = asyncio.run(run())
        shared = _shared_metric(engine)
        cached = engine.metrics.prefix_cache.hits.labels("memory")._value.get()  # type: ignore[union-attr]
    finally:
        engine.stop()
    assert [warm] == cold
    assert cached >= BOUNDARY
    assert shared == engine.runner.cache.shared_blocks(BOUNDARY)


def test_a_share_admission_counted_that_does_not_happen_copies_or_waits(artifact: Any) -> None:
    """Admission counts two questions as sharing the first one's document blocks; at their restore no holder is
    found (as when it left in between): the second copies the document, which still fits, and the third, which
    does not, holds nothing and waits until the blocks it needs are free, then runs. All answer as alone and
    every block comes back."""
    probe = _engine(artifact).runner.cache
    one = -(-(DOC_LEN + 50 + NEW) // probe.block_size)
    cache_bytes = (2 * one + 8) * probe.bytes_per_block + 4 * probe.reserved_bytes_per_slot
    specs = [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS)]
    engine = _engine(artifact, cache_bytes=cache_bytes, max_batch_size=4)
    live = engine.generations.reuse.live
    assert live is not None
    live.holder = lambda links, upto: None  # type: ignore[method-assign]
    blocked: list[int] = []
    sort = engine.generations.reuse.sort

    def sorting(jobs: Any) -> Any:
        out = sort(jobs)
        blocked.append(len(out.blocked))
        return out

    engine.generations.reuse.sort = sorting  # type: ignore[method-assign]
    engine.start()
    try:
        _together(engine, [_spec(QUESTIONS[0], seed=9)])

        async def run() -> list[Answer | BaseException]:
            with engine._cond:
                streams = [engine.generate(spec) for spec in specs]
            return list(await asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True))

        warm = asyncio.run(run())
        shared = _shared_metric(engine)
    finally:
        engine.stop()
    assert warm == _alone(artifact, specs)
    assert max(blocked) == 1  # the third waited once
    assert shared == 0
    _all_back(engine)


def test_a_job_waiting_for_blocks_whose_client_leaves_is_dropped(artifact: Any) -> None:
    """As above, the third question waits for blocks (admission counted a share that did not happen); its client
    leaves while it waits: it is dropped at once (counted at the prefill stage), while the others still run,
    never runs itself, and the others answer as alone; every block comes back."""
    probe = _engine(artifact).runner.cache
    long_new = 256  # the first two run long enough for the third to be seen waiting, and dropped meanwhile
    one = -(-(DOC_LEN + 50 + long_new) // probe.block_size)
    cache_bytes = (2 * one + 8) * probe.bytes_per_block + 4 * probe.reserved_bytes_per_slot
    specs = [_spec(q, seed=2 + i, new=long_new) for i, q in enumerate(QUESTIONS)]
    engine = _engine(artifact, cache_bytes=cache_bytes, max_batch_size=4)
    live = engine.generations.reuse.live
    assert live is not None
    live.holder = lambda links, upto: None  # type: ignore[method-assign]
    engine.start()
    try:
        _together(engine, [_spec(QUESTIONS[0], seed=9)])

        async def run() -> tuple[list[Answer], bool, bool]:
            with engine._cond:
                streams = [engine.generate(spec) for spec in specs]
            tasks = [asyncio.ensure_future(_collect(s)) for s in streams[:2]]
            while not engine.generations.blocked and not all(t.done() for t in tasks):
                await asyncio.sleep(0.001)
            waited = bool(engine.generations.blocked)
            streams[2].cancel()
            while streams[2].job.state is not JobState.DONE:
                await asyncio.sleep(0.001)  # dropped at the worker's next turn
            others_running = not all(t.done() for t in tasks)
            return [await t for t in tasks], waited, others_running

        answers, waited, others_running = asyncio.run(run())
        dropped = engine.metrics.dropped.labels("prefill")._value.get()  # type: ignore[attr-defined]
    finally:
        engine.stop()
    assert waited and others_running
    assert answers == _alone(artifact, specs[:2])
    assert dropped == 1 and not engine.generations.blocked
    _all_back(engine)


def test_prompt_key_chains_are_hashed_off_the_engine_lock(artifact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission reads a causal prompt's key chain under the lock the event loop takes to queue a request; the
    worker hashes it before taking that lock (a 500K-token chain takes about 12 ms), once per prompt."""
    from service.prefix_cache import PrefixCache

    engine = _engine(artifact)
    held: list[bool] = []
    links = PrefixCache.links

    def spy(self: PrefixCache, tokens: Any, salt: str | None) -> list[tuple[int, str]]:
        held.append(engine._cond._is_owned())  # type: ignore[attr-defined]
        return links(self, tokens, salt)

    monkeypatch.setattr(PrefixCache, "links", spy)
    engine.start()
    try:
        _together(engine, [_spec(q, seed=2 + i) for i, q in enumerate(QUESTIONS)])
    finally:
        engine.stop()
    assert held == [False] * 3
