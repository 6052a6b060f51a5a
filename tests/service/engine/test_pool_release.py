"""The decode cache's pool pages under load (service/memory.py HeapKeeper, service/engine/runner.py): a finished
request's pages go back beyond the kept blocks while others run, and over the budget every free page goes
back between turns; the running requests' results do not change."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from model.sampling import SamplingParams
from service import memory
from service.engine.core import Engine, EngineConfig
from service.engine.runner import ModelRunner
from service.jobs import GenerationSpec
from service.memory import HeapKeeper
from service.observability.memory_metrics import attributed_resident, mappings
from service.observability.metrics import ServiceMetrics
from tests.conftest import tiny_model

LINUX = memory.rss_bytes() > 0 and memory._LIBC.madvise is not None


def _pool_resident(runner: ModelRunner) -> int:
    maps = mappings()
    assert maps is not None
    return attributed_resident(runner.pool_storages(), maps)


def _decode(runner: ModelRunner, states: list[Any], last: torch.Tensor, steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        last = runner.decode([int(last.argmax())], states)[0]
        out.append(last)
    return out


@pytest.mark.skipif(not LINUX, reason="Linux /proc and madvise")
def test_a_finished_long_request_gives_its_pages_back_while_another_runs() -> None:
    # 2 KB of keys and values per token and LSH layer: a 1,900-token request writes past several 2 MiB huge
    # pages (two LSH layers: a local layer keeps only its window, model/decoding/local_ring.py)
    model = tiny_model(num_attention_heads=4, attention_head_size=64, attn_layers=["local", "lsh", "lsh"])
    runner = ModelRunner(model, torch.device("cpu"), max_slots=2, cache_bytes=64 * 2**20, cpu_kernel=False)
    short_prompt = [3 + i % 200 for i in range(40)]
    # the short request alone, as a reference for its bits
    logits, states = runner.prefill([short_prompt], [80])
    alone = _decode(runner, states, logits[0], 12)
    runner.free(states[0])
    runner.release_free_pages()

    logits, short = runner.prefill([short_prompt], [80])  # the lowest blocks
    running = _decode(runner, short, logits[0], 6)
    long_prompt = [2 + (i * 7) % 250 for i in range(1900)]
    long_logits, long = runner.prefill([long_prompt], [1908])
    runner.decode([int(long_logits[0].argmax())], long)
    written = _pool_resident(runner)
    runner.free(long[0])
    keeper = HeapKeeper(0.0, trim=lambda: False, release=runner.release_free_pages, keep_bytes=2**20)
    keeper.after_work()  # the turn in which the long request finished
    assert keeper.pool_released["finished"] >= 4 * 2**20
    # its pages are no longer resident: how many were depends on the host's huge pages (whole 2 MiB pages where
    # transparent huge pages back the pool, a few 4 KiB ones where they do not), so the measured drop is
    # asserted, not its size
    assert _pool_resident(runner) < written
    assert runner.cache.written_free_bytes <= 2**20 + runner.cache.bytes_per_block
    running += _decode(runner, short, running[-1], 6)  # the short request runs on, untouched
    assert all(torch.equal(a, b) for a, b in zip(alone, running, strict=True))
    before = keeper.pool_counters()
    keeper.after_work()
    assert keeper.pool_counters() == before  # nothing freed since: nothing more
    runner.free(short[0])


def test_the_budget_trim_gives_every_free_pool_page_back_and_finishes_keep_some() -> None:
    calls: list[int] = []

    def release(keep: int) -> int:
        calls.append(keep)
        return 2**21

    rss = [0]
    keeper = HeapKeeper(2.0, budget_bytes=100, trim=lambda: True, release=release, keep_bytes=4096,
                        rss=lambda: rss[0])
    keeper.after_work()  # under the budget: only the finished requests' release, keeping 4096 bytes
    assert calls == [4096] and keeper.trims["budget"] == 0
    rss[0] = 200
    keeper.last_budget_check = float("-inf")
    keeper.after_work()  # over the budget: the heap, then every free pool page
    assert calls == [4096, 4096, 0] and keeper.trims["budget"] == 1
    assert keeper.pool_counters() == {"finished": 2 * 2**21, "idle": 0, "busy": 0, "budget": 2**21}
    keeper.trim("idle")
    assert calls[-1] == 0 and keeper.pool_counters()["idle"] == 2**21


def test_a_failing_release_is_logged_and_not_retried_every_turn(caplog: Any) -> None:
    calls: list[int] = []

    def release(keep: int) -> int:
        calls.append(keep)
        raise OSError("injected")

    keeper = HeapKeeper(2.0, release=release, keep_bytes=0)
    keeper.after_work()
    keeper.after_work()
    assert calls == [0] and keeper.keep_bytes is None and "failed" in caplog.text


# ---- the engine's worker -------------------------------------------------------------------------------


class ReleaseRecorder:
    """The runner's release, recording its `keep` and whether a generation was running at each call."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.release = engine, engine.runner.release_free_pages
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, keep: int) -> int:
        released = self.release(keep)
        with self.lock:
            self.calls.append((keep, len(self.engine.generations.running)))
        return released


def _generate(engine: Engine, prompts: list[list[int]], new: int) -> None:
    async def one(prompt: list[int]) -> None:
        spec = GenerationSpec(prompt_ids=prompt, sampling=SamplingParams(), max_new_tokens=new, stop_on_eos=False)
        stream = engine.generate(spec)
        while (await stream.next_event()).finish is None:
            pass

    async def run() -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    asyncio.run(run())


def test_the_busy_engine_releases_after_a_request_finishes_and_over_the_budget(
        artifact: Any, started: list[Engine]) -> None:
    config = EngineConfig(warmup=False, idle_trim_s=0.0, memory_budget_bytes=1, cache_keep_bytes=2**20)
    engine = Engine(artifact.model, artifact.tokenizer, backend=None,  # type: ignore[arg-type]
                    device=None, config=config, metrics=ServiceMetrics())
    recorder = ReleaseRecorder(engine)
    engine.memory.release_function = recorder
    engine.memory.rss_function = lambda: 2  # always over the 1-byte budget
    engine.start()
    started.append(engine)
    _generate(engine, [[5, 6, 7], [8, 9, 10, 11]], 3)
    _generate(engine, [[5, 6, 7]], 30)
    with recorder.lock:
        calls = list(recorder.calls)
    assert (0, 1) in calls or (0, 2) in calls  # the budget's release between two steps of a running generation
    assert any(keep == 2**20 for keep, _ in calls)  # after each turn, keeping the lowest MiB of free blocks
    assert engine.memory.trims["budget"] >= 1 and engine.alive


def test_the_hot_bytes_stay_resident_on_every_release_but_the_budget_trims(caplog: Any) -> None:
    calls: list[int] = []

    def release(keep: int) -> int:
        calls.append(keep)
        return 0

    rss, hot, forgot = [0], [8192], [0]

    def forget() -> None:
        forgot[0] += 1

    keeper = HeapKeeper(2.0, budget_bytes=100, trim=lambda: True, release=release, keep_bytes=4096,
                        rss=lambda: rss[0], hot_bytes=lambda: hot[0], forget=forget)
    keeper.after_work()
    assert calls == [8192]  # a request finished: the larger of the two
    hot[0] = 1024
    keeper.after_work()
    assert calls[-1] == 4096
    keeper.trim("idle")
    keeper.trim("busy")
    assert calls[-2:] == [1024, 1024]  # idle or busy: the hot bytes stay
    assert forgot[0] == 0  # and so do the kept prefixes
    rss[0] = 200
    keeper.last_budget_check = keeper.last_trim_at = float("-inf")
    keeper.after_work()
    assert calls[-1] == 0 and keeper.trims["budget"] == 1  # over the budget: every free page goes
    assert forgot[0] == 1  # the kept prefixes' pages too

    def broken() -> int:
        raise RuntimeError("injected")

    keeper.hot_function = broken
    keeper.trim("idle")
    assert calls[-1] == 0 and "bytes to keep resident failed" in caplog.text
    assert keeper.describe()["decode_cache_keeps_prefix_hits"] is True


def test_a_kept_documents_blocks_stay_resident_for_the_next_question(artifact: Any, started: list[Engine]) -> None:
    from service.prefix_cache import PrefixCacheConfig

    config = EngineConfig(warmup=False, prefill="causal", idle_trim_s=0.05, cache_keep_bytes=1,
                          prefix_cache=PrefixCacheConfig(capacity_bytes=64 * 2**20, min_tokens=16))
    engine = Engine(artifact.model, artifact.tokenizer, backend=None,  # type: ignore[arg-type]
                    device=None, config=config, metrics=ServiceMetrics())
    assert engine.causal_prefill and engine.prefix_cache is not None
    engine.start()
    started.append(engine)
    doc = [3 + (i * 7) % 240 for i in range(1300)]
    _generate(engine, [doc + [9, 8, 7]], 2)
    cache = engine.runner.cache
    with engine._cond:
        wrote = set(cache.allocator.written)  # the request's blocks, written and now free
    kept = engine.prefix_cache.store.longest()
    assert kept == 1280  # the document's last block boundary
    live = engine.generations.reuse.live
    assert live is not None
    (prefix,) = live._kept.values()  # the request's blocks of the document, left behind when it finished
    assert len(prefix.blocks) == kept // cache.block_size == live.kept_blocks
    # as many free blocks as the kept state, besides the kept prefix: the next document's first read writes them
    assert engine._hot_bytes() == cache.bytes_for(kept)
    deadline = time.monotonic() + 20
    while engine.memory.trims["idle"] < 1:  # the idle trim gave back all it gives back
        assert time.monotonic() < deadline, "no idle trim"
        time.sleep(0.02)
    need = -(-engine._hot_bytes() // cache.bytes_per_block)
    with engine._cond:
        assert cache.kept_valid(prefix)
        # the kept prefix's pages stay, and so do those of the lowest other free blocks (the request's blocks past
        # the prefix among them), which a hit or the next document's first read takes: the rest went back
        carried = set(prefix.blocks.tolist())
        lowest = [b for b in cache.allocator.free_blocks() if b not in carried][:need]
        written = cache.allocator.written
        assert carried <= written and written - carried and written - carried <= set(lowest)
        assert wrote & set(lowest) <= written  # none of the request's pages among those went back


def test_info_says_prefix_hits_are_kept_resident_only_with_a_prefix_cache(artifact: Any) -> None:
    from service.prefix_cache import PrefixCacheConfig

    for prefix, kept in ((None, False), (PrefixCacheConfig(capacity_bytes=2**20, min_tokens=16), True)):
        engine = Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                        config=EngineConfig(warmup=False, prefix_cache=prefix), metrics=ServiceMetrics())
        assert engine.memory.describe()["decode_cache_keeps_prefix_hits"] is kept
        assert engine.memory._hot() == 0  # nothing kept yet
