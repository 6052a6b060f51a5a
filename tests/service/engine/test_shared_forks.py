"""Forks share their leader's prompt blocks in the engine (service/engine/prompt_reuse.py, DecodeCache.fork): n
choices of one prompt answer exactly as forks that copy the leader's state (shared_blocks off, the path before),
hold the prompt once (at most 1.1x the blocks of one choice), are admitted for their own part only, and give
every block back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from model.decoding import DecodeCache
from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig
from service.jobs import GenerationSpec
from service.observability.metrics import ServiceMetrics

PROMPT_LEN, NEW = 1500, 8


def _engine(artifact: Any, **config: Any) -> Engine:
    return Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                  config=EngineConfig(warmup=False, **config), metrics=ServiceMetrics())


def _specs(n: int) -> list[GenerationSpec]:
    prompt = torch.randint(3, 250, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()
    return [GenerationSpec(prompt_ids=prompt, sampling=SamplingParams(do_sample=True, seed=seed),
                           max_new_tokens=NEW, stop_on_eos=False) for seed in range(n)]


def _run(engine: Engine, specs: list[GenerationSpec]) -> list[list[int]]:
    async def one(spec: GenerationSpec) -> list[int]:
        stream = engine.generate(spec)
        ids: list[int] = []
        while True:
            event = await stream.next_event()
            ids.append(event.id)
            if event.finish is not None:
                return ids

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(s) for s in specs)))

    return asyncio.run(all_of())


def _peak_blocks(cache: DecodeCache) -> list[int]:
    """Records the blocks in use after every allocation and fork of `cache`."""
    peak = [0]
    allocate, fork = cache.allocate, cache.fork

    def note() -> None:
        peak[0] = max(peak[0], cache.blocks - 1 - cache.free_blocks)

    def allocating(*args: Any, **kwargs: Any) -> Any:
        out = allocate(*args, **kwargs)
        note()
        return out

    def forking(*args: Any, **kwargs: Any) -> None:
        fork(*args, **kwargs)
        note()

    cache.allocate, cache.fork = allocating, forking  # type: ignore[method-assign]
    return peak


def _forks(engine: Engine) -> float:
    return engine.metrics.prefix_cache.forks._value.get()  # type: ignore[attr-defined,union-attr]


def _served(artifact: Any, n: int, **config: Any) -> tuple[list[list[int]], int, float]:
    engine = _engine(artifact, **config)
    peak = _peak_blocks(engine.runner.cache)
    engine.start()
    try:
        answers = _run(engine, _specs(n))
        forks = _forks(engine)
    finally:
        engine.stop()
    cache = engine.runner.cache
    assert cache.allocated_bytes == 0 and all(cache.refs(b) == 0 for b in range(cache.blocks))
    assert cache.free_blocks == cache.blocks - 1 and cache.free_spare_orders == cache.blocks - 1
    return answers, peak[0], forks


def test_n_forks_answer_as_copies_and_hold_the_prompt_once(artifact: Any) -> None:
    one, one_blocks, _ = _served(artifact, 1)
    shared, shared_blocks, shared_forks = _served(artifact, 4)
    copied, copied_blocks, copied_forks = _served(artifact, 4, shared_blocks=False)
    assert shared == copied and shared[0] == one[0]
    assert len({tuple(a) for a in shared}) > 1  # each choice its own seed
    assert shared_forks == copied_forks == 3
    assert shared_blocks <= 1.1 * one_blocks
    assert copied_blocks >= 3.9 * one_blocks


@pytest.mark.parametrize("share", [True, False])
def test_admission_reserves_a_forks_own_part(artifact: Any, share: bool) -> None:
    """A cache with room for about three copies of the request: sharing, all four choices start together (three
    forks); copying, the fourth waits for room and prefills alone once the others are done."""
    probe = _engine(artifact, max_batch_size=4).runner.cache
    blocks = 3 * -(-(PROMPT_LEN + NEW) // probe.block_size) + 8
    cache_bytes = blocks * probe.bytes_per_block + 5 * probe.reserved_bytes_per_slot
    answers, _, forks = _served(artifact, 4, max_batch_size=4, cache_bytes=cache_bytes, shared_blocks=share)
    assert len(answers) == 4 and all(len(a) == NEW for a in answers)
    assert forks == (3 if share else 2)


def test_identical_prompts_that_hit_together_restore_one_copy(artifact: Any) -> None:
    """Two choices of a prompt the prefix cache holds: the first restores the kept state, the second forks it (one
    copy in the decode cache), and both answer what a cache-off server answers."""
    from tests.service.helpers import metric_value, running_app

    prompt = "The lighthouse keeper climbed the stairs at dusk and lit the great lamp once more. " * 3
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 2}
    limits: dict[str, Any] = dict(prefill="one-piece", max_new_tokens=16, max_input_tokens=600,
                                  prefix_cache_min_tokens=16)
    with running_app(artifact, **limits, prefix_cache=False) as off:
        want = off.post("/v1/completions", json=body).json()
    with running_app(artifact, **limits) as on:
        on.post("/v1/completions", json={**body, "n": 1}).raise_for_status()  # kept
        before = metric_value(on.get("/metrics").text, "reformer_prefix_cache_forks_total")
        got = on.post("/v1/completions", json=body).json()
        metrics = on.get("/metrics").text
        engine = on.app.state.service.engine  # type: ignore[attr-defined]
        assert engine.runner.stats()["cache_bytes"] == 0
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    assert metric_value(metrics, "reformer_prefix_cache_forks_total") == before + 1
