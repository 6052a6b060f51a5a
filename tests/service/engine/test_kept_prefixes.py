"""A finished causal request leaves its prompt's blocks behind in the decode cache (service/engine/live_prefixes.py
`retire`, model/decoding/block_allocator.py `keep`): a later question about the same document shares them
instead of copying the document's kept state into fresh blocks, and answers bit for bit what it answers alone on
a server with an empty cache. The blocks stay free: a request that needs them takes them (the kept prefix ends,
and the next question copies again, with the same answer), and the memory budget's trim ends them all."""

from __future__ import annotations

from typing import Any

import numpy as np

from model.sampling import SamplingParams
from service.engine.core import Engine
from service.jobs import GenerationSpec
from service.observability.memory_metrics import MemoryCollector

from .test_shared_prefix import (
    BOUNDARY,
    DOC_LEN,
    LONG_QUESTION,
    NEW,
    QUESTIONS,
    _all_back,
    _alone,
    _engine,
    _shared_metric,
    _spec,
)
from .test_shared_prefix import _together as together


def _live(engine: Engine) -> Any:
    live = engine.generations.reuse.live
    assert live is not None
    return live


def _kept(engine: Engine) -> list[Any]:
    return list(_live(engine)._kept.values())


def test_a_later_question_shares_the_blocks_the_first_left_behind(artifact: Any) -> None:
    first, later = _spec(QUESTIONS[0], seed=1), _spec(QUESTIONS[1], seed=2)
    cold = _alone(artifact, [later])
    engine = _engine(artifact)
    cache = engine.runner.cache
    engine.start()
    try:
        together(engine, [first])
        (prefix,) = _kept(engine)
        k = cache.shared_blocks(BOUNDARY)
        assert len(prefix.blocks) == -(-BOUNDARY // cache.block_size) >= k  # up to the kept state's length
        assert cache.free_blocks == cache.blocks - 1  # kept, yet free
        assert cache.kept_prefix_bytes == len(prefix.blocks) * cache.bytes_per_block
        gauges = {m.name: m.samples[0].value for m in MemoryCollector(lambda: engine.memory,
                                                                      runner=lambda: engine.runner).collect()}
        assert gauges["reformer_decode_cache_kept_prefix_bytes"] == cache.kept_prefix_bytes
        assert engine.generations.reuse.keeps_prefixes  # what /info's prefix_cache.kept_prefixes reads
        orders = cache.free_spare_orders
        allocate, seen = cache.allocate, []

        def allocating(*args: Any, **kwargs: Any) -> Any:
            state = allocate(*args, **kwargs)
            seen.append((state.shared, cache.free_spare_orders))
            return state

        cache.allocate = allocating  # type: ignore[method-assign]
        warm = together(engine, [later])
        assert seen == [(k, orders)]  # the one sharer took the blocks' own order rows, no spare ones
        shared = _shared_metric(engine)
    finally:
        engine.stop()
    assert warm == cold
    assert shared == k
    _all_back(engine)


def test_a_request_that_needs_the_blocks_ends_the_kept_prefix(artifact: Any) -> None:
    """A decode cache with room for one document and a little: an unrelated long prompt takes the kept blocks.
    The next question then copies the document's state from the prefix cache, with the same answer."""
    probe = _engine(artifact).runner.cache
    one = -(-(DOC_LEN + 50 + NEW) // probe.block_size)
    engine = _engine(artifact, cache_bytes=(one + 8) * probe.bytes_per_block + 3 * probe.reserved_bytes_per_slot,
                     max_batch_size=2)
    cache = engine.runner.cache
    later = _spec(QUESTIONS[1], seed=2)
    cold = _alone(artifact, [later])
    other = [int(t) for t in np.random.default_rng(5).integers(3, 250, DOC_LEN)]
    engine.start()
    try:
        together(engine, [_spec(QUESTIONS[0], seed=1)])
        (prefix,) = _kept(engine)
        together(engine, [GenerationSpec(prompt_ids=other, sampling=SamplingParams(), max_new_tokens=NEW,
                                         stop_on_eos=False)])
        assert not cache.kept_valid(prefix)  # its blocks were handed out
        before = _shared_metric(engine)
        warm = together(engine, [later])
        shared = _shared_metric(engine) - before
    finally:
        engine.stop()
    assert warm == cold
    assert shared == 0  # copied: nothing was left to share
    _all_back(engine)


def test_the_budget_trim_ends_the_kept_prefixes(artifact: Any) -> None:
    engine = _engine(artifact)
    cache = engine.runner.cache
    engine.start()
    try:
        together(engine, [_spec(QUESTIONS[0], seed=1)])
        (prefix,) = _kept(engine)
        with engine._cond:  # the worker waits for work under this lock: the trim runs between its turns
            assert engine.memory.forget_function is not None
            engine.memory.forget_function()
            assert not cache.kept_valid(prefix) and _live(engine).kept_blocks == 0
            assert not cache.allocator.kept_by.any()
    finally:
        engine.stop()
    _all_back(engine)


def test_cut_back_orders_are_kept_on_one_state_at_a_time(artifact: Any, monkeypatch: Any) -> None:
    """Two documents whose first questions kept their states past the document: each later question cuts a
    state back, and the orders the cut built stay on the last state cut only (StateSnapshot.cut)."""
    from service.engine import prompt_reuse

    cuts: list[Any] = []
    restore = prompt_reuse.restore_prefix

    def recording(cache: Any, config: Any, snap: Any, state: Any, length: int) -> Any:
        cuts.append(snap)
        return restore(cache, config, snap, state, length)

    monkeypatch.setattr(prompt_reuse, "restore_prefix", recording)
    other = [int(t) for t in np.random.default_rng(7).integers(3, 250, DOC_LEN)]
    engine = _engine(artifact)
    engine.start()
    try:
        for doc in (None, other):
            def spec(question: list[int], seed: int, doc: list[int] | None = doc) -> GenerationSpec:
                s = _spec(question, seed)
                return s if doc is None else GenerationSpec(prompt_ids=doc + question, sampling=s.sampling,
                                                            max_new_tokens=NEW, stop_on_eos=False)

            together(engine, [spec(LONG_QUESTION, 1)])  # kept at 1,792: past the document
            together(engine, [spec(QUESTIONS[1], 2)])  # cut back to 1,280
    finally:
        engine.stop()
    first, second = cuts
    assert first is not second
    assert first.cut is None and second.cut is not None and second.cut[0] == BOUNDARY
