"""The heap keeper (service/memory.py): the model worker trims the heap once per idle spell and never while
work runs or waits, over a memory budget between turns, and a failing trim breaks nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from model.sampling import SamplingParams
from service import memory
from service.engine.core import Engine, EngineConfig
from service.engine.runner import ModelRunner
from service.jobs import GenerationSpec
from service.memory import BUDGET_CHECK_S, BUDGET_TRIM_INTERVAL_S, HeapKeeper
from service.observability.metrics import ServiceMetrics
from tests.conftest import tiny_model


class FakeClock:
    """Reads `now`; with a `step`, moves that far at every reading (time that passes with the worker's turns)."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 100.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _keeper(idle_s: float = 2.0, budget: int = 0, rss: Callable[[], int] = lambda: 0,
            trim: Callable[[], bool] | None = None, busy_s: float = 0.0) -> tuple[HeapKeeper, FakeClock, list[float]]:
    clock = FakeClock()
    calls: list[float] = []

    def fake_trim() -> bool:
        calls.append(clock.now)
        return True

    return HeapKeeper(idle_s, budget, trim=trim or fake_trim, rss=rss, clock=clock, busy_trim_s=busy_s), clock, calls


def test_idle_trim_falls_due_after_the_idle_period_once_per_spell() -> None:
    keeper, clock, calls = _keeper(idle_s=2.0)
    assert not keeper.idle_turn(True)
    assert keeper.idle_wait(None) == pytest.approx(2.0)  # wakes when the trim falls due
    assert keeper.idle_wait(0.5) == pytest.approx(0.5)  # an earlier wake-up stays
    clock.now += 2.0
    assert keeper.idle_turn(True)
    keeper.trim("idle")
    assert calls == [clock.now] and keeper.trims == {"idle": 1, "busy": 0, "budget": 0}
    clock.now += 60
    assert not keeper.idle_turn(True)  # the same spell: no second trim
    assert keeper.idle_wait(None) is None  # and no polling: wait until notified
    keeper.after_work()  # work ran: a new spell
    clock.now += 1.9
    assert not keeper.idle_turn(True)
    clock.now += 0.1
    assert keeper.idle_turn(True)


def test_queued_work_is_not_idleness_and_zero_disables() -> None:
    keeper, clock, _ = _keeper(idle_s=2.0)
    clock.now += 5
    assert not keeper.idle_turn(False)  # an embedding waiting for company
    assert keeper.idle_wait(0.004) == 0.004 and keeper.idle_wait(None) is None
    clock.now += 1
    assert not keeper.idle_turn(True)  # the spell began when the queue emptied
    off, clock, _ = _keeper(idle_s=0.0)
    clock.now += 1000
    assert not off.idle_turn(True) and off.idle_wait(None) is None


def test_a_failing_trim_is_logged_not_raised_and_not_retried_in_the_spell(caplog: Any) -> None:
    def broken() -> bool:
        raise OSError("no")

    keeper, clock, _ = _keeper(trim=broken)
    clock.now += 3
    assert keeper.idle_turn(True)
    with caplog.at_level(logging.WARNING, logger="service.memory"):
        keeper.trim("idle")
    assert "memory trim failed" in caplog.text and keeper.trims["idle"] == 0
    assert not keeper.idle_turn(True)


def test_budget_trims_between_turns_only_over_the_budget_and_not_too_often() -> None:
    rss = [500]
    keeper, clock, calls = _keeper(budget=1000, rss=lambda: rss[0])
    keeper.after_work()
    assert calls == []  # under the budget
    rss[0] = 2000
    keeper.after_work()
    assert calls == []  # the RSS is read at most every BUDGET_CHECK_S
    clock.now += BUDGET_CHECK_S
    keeper.after_work()
    assert len(calls) == 1 and keeper.trims == {"idle": 0, "busy": 0, "budget": 1}
    for _ in range(int(BUDGET_TRIM_INTERVAL_S / BUDGET_CHECK_S) - 1):
        clock.now += BUDGET_CHECK_S
        keeper.after_work()
    assert len(calls) == 1  # still over, but within the interval
    clock.now += BUDGET_CHECK_S
    keeper.after_work()
    assert len(calls) == 2


def test_busy_trims_once_every_period_of_work_and_any_trim_restarts_the_period(caplog: Any) -> None:
    keeper, clock, calls = _keeper(busy_s=30.0)
    for _ in range(29):
        clock.now += 1
        keeper.after_work()
    assert calls == []  # 29 s of work since the start
    clock.now += 1
    keeper.after_work()
    assert calls == [clock.now] and keeper.trims == {"idle": 0, "busy": 1, "budget": 0}
    clock.now += 20
    keeper.trim("idle")  # an idle trim in between: the next busy one is 30 s after it
    clock.now += 29
    keeper.after_work()
    assert len(calls) == 2
    clock.now += 1
    keeper.after_work()
    assert len(calls) == 3 and keeper.trims == {"idle": 1, "busy": 2, "budget": 0}
    off, clock, calls = _keeper(busy_s=0.0)
    clock.now += 10_000
    off.after_work()
    assert calls == []

    def broken() -> bool:
        raise OSError("no")

    failing, clock, _ = _keeper(busy_s=30.0, trim=broken)
    tries = []
    failing.trim_function = lambda: tries.append(clock.now) or broken()  # type: ignore[func-returns-value]
    with caplog.at_level(logging.WARNING, logger="service.memory"):
        for _ in range(40):
            clock.now += 1
            failing.after_work()
    assert len(tries) == 1  # a failing busy trim is not retried every turn


def test_the_trim_records_what_it_released() -> None:
    rss = [3000]

    def trim() -> bool:
        rss[0] = 1000
        return True

    keeper, _, _ = _keeper(rss=lambda: rss[0], trim=trim)
    keeper.trim("idle")
    assert keeper.counters()[0]["idle"] == 1 and keeper.counters()[2] == 2000


def test_off_glibc_nothing_is_available_and_nothing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory._LIBC, "trim", None)
    monkeypatch.setattr(memory._LIBC, "mallinfo2", None)
    assert memory.heap_stats() is None and memory.malloc_trim() is False
    keeper = HeapKeeper(0.001)
    time.sleep(0.01)
    assert not keeper.idle_enabled and not keeper.idle_turn(True) and keeper.idle_wait(None) is None
    keeper.trim("idle")  # a no-op
    assert keeper.describe()["malloc_trim_available"] is False


@pytest.mark.skipif(memory._LIBC.mallinfo2 is None, reason="glibc's mallinfo2 only")
def test_heap_stats_and_trim_on_glibc() -> None:
    stats = memory.heap_stats()
    assert stats is not None and 0 < stats.in_use <= stats.mapped and stats.free >= 0
    assert memory.malloc_trim() in (True, False) and memory.rss_bytes() > 0


# ---- the engine's worker -------------------------------------------------------------------------------


class Recorder:
    """A fake malloc_trim that records the engine's work at each call (the worker makes it)."""

    def __init__(self, engine: Engine, fail: bool = False) -> None:
        self.engine = engine
        self.fail = fail
        self.busy_at_calls: list[int] = []
        self.times: list[float] = []
        self.lock = threading.Lock()

    def __call__(self) -> bool:
        e = self.engine
        with self.lock:
            busy = len(e.generations.running) + len(e.generations.prefilling) + len(e._gen_queue) + len(e.embeds.items)
            self.busy_at_calls.append(busy)
            self.times.append(time.monotonic())
        if self.fail:
            raise RuntimeError("injected trim failure")
        return True

    @property
    def calls(self) -> int:
        with self.lock:
            return len(self.busy_at_calls)


def _engine(artifact: Any, idle_s: float, budget: int = 0, busy_s: float = 0.0) -> Engine:
    return Engine(artifact.model, artifact.tokenizer, backend=None,  # type: ignore[arg-type]
                  device=None, config=EngineConfig(warmup=False, idle_trim_s=idle_s, memory_budget_bytes=budget,
                                                   busy_trim_s=busy_s),
                  metrics=ServiceMetrics())


def _generate(engine: Engine, new: int) -> list[int]:
    async def run() -> list[int]:
        spec = GenerationSpec(prompt_ids=[5, 6, 7], sampling=SamplingParams(), max_new_tokens=new, stop_on_eos=False)
        stream = engine.generate(spec)
        ids = []
        while True:
            event = await stream.next_event()
            ids.append(event.id)
            if event.finish is not None:
                return ids

    return asyncio.run(run())


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_idle_engine_trims_once_per_spell_and_never_while_work_runs(artifact: Any, started: list[Engine]) -> None:
    engine = _engine(artifact, idle_s=0.3)
    recorder = Recorder(engine)
    engine.memory.trim_function = recorder
    engine.start()
    started.append(engine)
    _wait_for(lambda: recorder.calls == 1)  # the start's spell
    began = time.monotonic()
    assert len(_generate(engine, 60)) == 60
    ended = time.monotonic()
    _wait_for(lambda: recorder.calls == 2)  # the spell after the generation
    time.sleep(1.0)  # idle well past the period: no second trim in the same spell (no polling loop)
    assert recorder.calls == 2
    assert recorder.busy_at_calls == [0, 0]  # nothing running or queued at either trim
    assert not any(began < t < ended for t in recorder.times)  # none while the generation ran
    assert engine.memory.trims["idle"] == 2 and engine.alive


def test_a_failing_trim_breaks_no_request(artifact: Any, started: list[Engine]) -> None:
    engine = _engine(artifact, idle_s=0.05)
    recorder = Recorder(engine, fail=True)
    engine.memory.trim_function = recorder
    engine.start()
    started.append(engine)
    _wait_for(lambda: recorder.calls >= 1)
    for _ in range(3):
        assert len(_generate(engine, 5)) == 5
        _wait_for(lambda: recorder.calls >= 2)
    assert engine.alive and engine.memory.trims["idle"] == 0


def test_over_the_budget_the_busy_engine_trims_between_steps(artifact: Any, started: list[Engine]) -> None:
    engine = _engine(artifact, idle_s=0.0, budget=1)  # idle trim off: only the budget acts
    recorder = Recorder(engine)
    engine.memory.trim_function = recorder
    engine.memory.rss_function = lambda: 2  # always over the 1-byte budget
    engine.start()
    started.append(engine)
    assert len(_generate(engine, 8)) == 8
    assert engine.memory.trims == {"idle": 0, "busy": 0, "budget": 1}  # at most one per BUDGET_TRIM_INTERVAL_S
    assert recorder.busy_at_calls == [1]  # between two steps of the running generation


def test_the_busy_engine_trims_every_period_between_steps(artifact: Any, started: list[Engine]) -> None:
    engine = _engine(artifact, idle_s=0.0, busy_s=0.01)  # idle trim off: only the busy trim acts
    recorder = Recorder(engine)
    engine.memory.trim_function = recorder
    # a clock that moves 4 ms at every reading: the trims follow the worker's turns, not how fast this host
    # decodes (a fast host ran all 80 steps of the tiny model inside one real 10 ms period)
    engine.memory.clock = FakeClock(step=0.004)
    engine.memory.next_busy_trim = engine.memory.clock() + engine.memory.busy_trim_s
    engine.start()
    started.append(engine)
    first = _generate(engine, 80)
    assert len(first) == 80
    assert engine.memory.trims["busy"] >= 2 and engine.memory.trims["idle"] == 0
    assert 1 in recorder.busy_at_calls  # between two steps of the running generation
    assert _generate(engine, 80) == first  # greedy: the trims change no result


# ---- the decode cache's pools --------------------------------------------------------------------------


def _greedy_run(runner: ModelRunner, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    logits, states = runner.prefill([prompt], [len(prompt) + new])
    tokens, last = [], logits[0]
    try:
        for _ in range(new):
            tokens.append(int(last.argmax()))
            last = runner.decode([tokens[-1]], states)[0]
    finally:
        runner.free(states[0])
    return tokens, last


@pytest.mark.skipif(memory.rss_bytes() == 0 or memory._LIBC.madvise is None, reason="Linux /proc and madvise")
def test_idle_release_gives_the_pools_pages_back_and_changes_no_result() -> None:
    # heads x head size of 256 floats: 2 KB of keys and values per token and LSH layer, so a 1,900-token
    # request writes past the first 2 MiB huge page of each LSH layer's pool (a local layer keeps only its
    # window, model/decoding/local_ring.py)
    model = tiny_model(num_attention_heads=4, attention_head_size=64, attn_layers=["local", "lsh", "lsh"])
    runner = ModelRunner(model, torch.device("cpu"), max_slots=2, cache_bytes=64 * 2**20, cpu_kernel=False)
    prompt = [2 + (i * 7) % 250 for i in range(1900)]
    first = _greedy_run(runner, prompt, 8)  # writes about 7.6 MB of keys and values, then frees them
    assert runner.release_free_pages(keep_bytes=runner.cache.capacity_bytes) == 0  # every free block kept
    before = memory.rss_bytes()
    assert runner.release_free_pages() > 0
    assert before - memory.rss_bytes() >= 4 * 2**20  # block 0's huge page and the unaligned ends stay
    assert runner.release_free_pages() == 0  # nothing written since
    again = _greedy_run(runner, prompt, 8)
    assert again[0] == first[0] and torch.equal(again[1], first[1])  # the same tokens and the same bits
