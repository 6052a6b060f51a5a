"""The engine's parts with a real tiny model and no HTTP: one request's failure fails it alone, prompt tokens
are counted for completed requests only, and admission goes by decode-cache bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from model.sampling import SamplingParams
from service.engine.core import Engine, EngineConfig
from service.engine.jobs_runtime import GenerationJob, JobState
from service.errors import InputTooLong, InternalError
from service.jobs import GenerationSpec
from service.observability.metrics import ServiceMetrics
from tests.service.helpers import observed_slices


def _engine(artifact: Any, **config: Any) -> Engine:
    return Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                  config=EngineConfig(warmup=False, **config), metrics=ServiceMetrics())


@pytest.fixture
def engine(artifact: Any) -> Iterator[Engine]:
    e = _engine(artifact)
    e.start()
    yield e
    e.stop()


def _spec(prompt: list[int], new: int = 6) -> GenerationSpec:
    return GenerationSpec(prompt_ids=prompt, sampling=SamplingParams(), max_new_tokens=new, stop_on_eos=False)


async def _collect(engine: Engine, spec: GenerationSpec) -> list[int] | Exception:
    stream = engine.generate(spec)
    ids: list[int] = []
    try:
        while True:
            event = await stream.next_event()
            ids.append(event.id)
            if event.finish is not None:
                return ids
    except Exception as exc:  # noqa: BLE001
        return exc


def _run(engine: Engine, *specs: GenerationSpec) -> list[list[int] | Exception]:
    async def all_of() -> list[list[int] | Exception]:
        return list(await asyncio.gather(*(_collect(engine, s) for s in specs)))

    return asyncio.run(all_of())


def _prompt_tokens(engine: Engine) -> float:
    return engine.metrics.prompt_tokens._value.get()  # type: ignore[attr-defined]


def test_a_failing_prefill_fails_that_request_alone(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.runner.prefill

    def prefill(prompts: Any, reserve: Any) -> Any:
        if any(99 in p for p in prompts):
            raise RuntimeError("injected")
        return real(prompts, reserve)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    good, bad, other = _run(engine, _spec([5, 6, 7]), _spec([99, 6]), _spec([8, 9]))
    assert isinstance(bad, InternalError)
    assert isinstance(good, list) and len(good) == 6 and isinstance(other, list) and len(other) == 6
    assert _prompt_tokens(engine) == 5  # the failed request's prompt is not counted
    assert engine.runner.cache.allocated_bytes == 0  # every cache went back


def test_a_failing_sample_fails_that_request_alone(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = GenerationJob.accept

    def accept(self: GenerationJob, logits: Any, greedy: Any = None) -> Any:
        if self.spec.prompt_ids[0] == 98 and len(self.generated) == 2:
            raise RuntimeError("injected")
        return real(self, logits, greedy)

    monkeypatch.setattr(GenerationJob, "accept", accept)
    alone = _run(engine, _spec([5, 6, 7], 8))[0]
    good, bad = _run(engine, _spec([5, 6, 7], 8), _spec([98, 6, 7], 8))
    assert isinstance(bad, InternalError)
    assert good == alone  # batched with a failing request: same tokens as alone, to the end
    assert _prompt_tokens(engine) == 6
    assert engine.runner.cache.allocated_bytes == 0


def test_admission_by_decode_cache_bytes(artifact: Any) -> None:
    cache = _engine(artifact).runner.cache
    # room for 3 blocks of 16 positions: one request of 3 + 20 positions (2 blocks), not two
    engine = _engine(artifact, cache_bytes=3 * cache.bytes_per_block + cache.bytes_per_slot * (cache.max_slots + 1))
    assert engine.runner.cache.free_blocks == 3
    steps: list[int] = []
    real = engine.runner.decode

    def decode(tokens: Any, states: Any) -> Any:
        steps.append(len(states))
        return real(tokens, states)

    engine.runner.decode = decode  # type: ignore[method-assign]
    engine.start()
    try:
        with pytest.raises(InputTooLong, match="REFORMER_CACHE_BYTES"):
            _run_raising(engine, _spec(list(range(5, 45)), 200))
        a, b = _run(engine, _spec([5, 6, 7], 20), _spec([8, 9, 10], 20))
        assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 20
        assert max(steps) == 1  # the second waited in the queue until the first had left the cache
        assert engine.stats()["cache_bytes"] == 0 and engine.stats()["cache_capacity_bytes"] > 0
    finally:
        engine.stop()


def test_a_request_longer_than_the_cache_was_built_for_is_refused_naming_that_limit(artifact: Any) -> None:
    engine = _engine(artifact, max_request_tokens=40)
    assert engine.runner.cache.max_tokens == 40
    with pytest.raises(InputTooLong, match=r"\(45 tokens\) is more than the 40 tokens the decode cache was built"):
        _run_raising(engine, _spec(list(range(5, 25)), 25))
    engine.stop()


def _run_raising(engine: Engine, spec: GenerationSpec) -> None:
    async def go() -> None:
        engine.generate(spec)

    asyncio.run(go())


def _record_slices(engine: Engine, monkeypatch: pytest.MonkeyPatch, budget_s: float) -> list[str]:
    """Long prompts (over 50 tokens) sliced, the prefill budget set; returns the calls as they happen:
    "d" a decode step that includes the first request decoding after the list is cleared (the stream),
    "x" one without it, "s" a prefill slice."""
    import service.engine.generation_steps as steps_module

    monkeypatch.setattr(steps_module, "CHUNKED_PREFILL_TOKENS", 50)
    monkeypatch.setattr(engine.generations, "prefill_budget_s", budget_s)
    calls: list[str] = []
    real_decode, real_slices = engine.runner.decode, engine.runner.prefill_slices

    stream: list[Any] = []

    def decode(tokens: Any, states: Any) -> Any:
        if "d" not in calls and "x" not in calls:  # the first decode step since the list was cleared
            stream[:] = [states[0]]
        calls.append("d" if any(s is stream[0] for s in states) else "x")
        return real_decode(tokens, states)

    def prefill_slices(prompts: Any, reserve: Any) -> Any:
        return observed_slices(real_slices(prompts, reserve), lambda: calls.append("s"))

    monkeypatch.setattr(engine.runner, "decode", decode)
    monkeypatch.setattr(engine.runner, "prefill_slices", prefill_slices)
    return calls


def _long_prompt_while_streaming(engine: Engine, long_prompt: list[int]) -> list[list[int] | Exception]:
    async def both() -> list[list[int] | Exception]:
        stream = engine.generate(_spec([5, 6, 7], 200))
        ids = [(await stream.next_event()).id]
        # the stream is running (199 steps to go) when the long prompt arrives: a fixed sleep before it was
        # longer than the whole stream once the tiny model's step took a tenth of a millisecond
        long = asyncio.create_task(_collect(engine, _spec(long_prompt, 4)))
        while True:
            event = await stream.next_event()
            ids.append(event.id)
            if event.finish is not None:
                return [await long, ids]

    return asyncio.run(both())


def _slices_and_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch, budget: float) -> str:
    """A long prompt's prefill while a stream decodes, under `budget`: its output equals the prompt alone;
    returns the engine's calls in order ("s": a prefill slice, "d": a decode step)."""
    calls = _record_slices(engine, monkeypatch, budget)
    long_prompt = [5 + i % 200 for i in range(300)]
    alone = _run(engine, _spec(long_prompt, 4))[0]
    calls.clear()
    long_out, stream_out = _long_prompt_while_streaming(engine, long_prompt)
    assert long_out == alone and isinstance(stream_out, list) and len(stream_out) == 200
    return "".join(calls)


def test_a_long_prefill_is_sliced_between_decode_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    sliced = _slices_and_steps(engine, monkeypatch, 0.0)  # no budget: one slice per decode step
    assert "s" in sliced and "d" in sliced[sliced.index("s"):sliced.rindex("s")]  # decode steps between slices
    # while the stream still decodes, no two slices run back to back (once it has finished, nothing waits)
    assert "ss" not in sliced[: sliced.rindex("d")]


def test_prefill_slices_run_until_the_budget_between_decode_steps(engine: Engine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sliced = _slices_and_steps(engine, monkeypatch, 60.0)  # a budget no slice sequence here reaches
    assert sliced.count("s") > 1 and "d" not in sliced[sliced.index("s"):sliced.rindex("s")]  # all in one turn


def _histogram(engine: Engine, kind: str) -> tuple[float, float]:
    """(count, sum) of reformer_batch_size{kind}."""
    samples = {s.name: s.value for m in engine.metrics.batch_size.collect() for s in m.samples
               if s.labels.get("kind") == kind}
    return samples.get("reformer_batch_size_count", 0.0), samples.get("reformer_batch_size_sum", 0.0)


def test_batch_size_counts_rows_per_model_call(artifact: Any) -> None:
    engine = _engine(artifact)
    rows: list[int] = []
    real = engine.runner.decode

    def decode(tokens: Any, states: Any) -> Any:
        rows.append(len(states))
        return real(tokens, states)

    engine.runner.decode = decode  # type: ignore[method-assign]

    async def scenario() -> list[list[int] | Exception]:
        tasks = [asyncio.create_task(_collect(engine, _spec(p, 5))) for p in ([5, 6, 7], [8, 9, 10], [11, 12])]
        await asyncio.sleep(0.01)  # all three are queued before the worker starts
        engine.start()
        return list(await asyncio.gather(*tasks))

    try:
        outs = asyncio.run(scenario())
    finally:
        engine.stop()
    assert all(isinstance(o, list) and len(o) == 5 for o in outs)
    assert _histogram(engine, "prefill") == (1.0, 3.0)  # the three prompts were prefilled in one call
    assert rows and max(rows) == 3  # and decoded together
    assert _histogram(engine, "decode") == (float(len(rows)), float(sum(rows)))


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "bucketed"])
def test_batched_generation_equals_the_request_alone(artifact: Any, invariant: bool) -> None:
    engine = _engine(artifact, batch_invariant=invariant)
    engine.start()

    async def logprobs(spec: GenerationSpec) -> list[tuple[int, float]]:
        stream, out = engine.generate(spec), []
        while True:
            event = await stream.next_event()
            out.append((event.id, event.logprob))
            if event.finish is not None:
                return out

    async def together() -> list[list[tuple[int, float]]]:
        return list(await asyncio.gather(logprobs(_spec([5, 6, 7], 12)), logprobs(_spec(list(range(20, 60)), 5)),
                                         logprobs(_spec([9], 9))))

    try:
        alone = asyncio.run(logprobs(_spec([5, 6, 7], 12)))
        batched = asyncio.run(together())[0]
    finally:
        engine.stop()
    assert [i for i, _ in batched] == [i for i, _ in alone]  # same greedy tokens
    if invariant:
        assert batched == alone  # bit for bit
    else:
        assert max(abs(a - b) for (_, a), (_, b) in zip(alone, batched)) <= 1e-4


def test_a_non_streaming_generation_gets_its_tokens_together_at_the_end(engine: Engine) -> None:
    async def run(stream: bool) -> tuple[list[tuple[int, float]], int]:
        handle = engine.generate(_spec([5, 6, 7], 150), stream=stream)
        queued_while_running = 0
        while handle.job.state is not JobState.DONE:  # how many events reached the loop before the end
            if handle.job.generated:
                queued_while_running = max(queued_while_running, handle.job.events.qsize())
            await asyncio.sleep(0.001)
        events = []
        while True:
            event = await handle.next_event()
            events.append((event.id, event.logprob))
            if event.finish is not None:
                return events, queued_while_running

    streamed, seen_streaming = asyncio.run(run(True))
    together, seen_together = asyncio.run(run(False))
    assert together == streamed and len(together) == 150  # the same tokens, in order
    assert seen_together == 0 and seen_streaming > 0


def test_invariant_steps_keep_their_bits_on_a_host_with_more_cores() -> None:
    """With 4 intra-op threads (a larger host than CI's), steps of more than 4 rows would run on 3 threads,
    where the per-layer path's products take PyTorch's threaded matmul (the one-call step gives the same bits
    on any count); invariant mode keeps every step on one thread, so a row batched with five others gets the
    bits it gets alone, in one model call."""
    from model import ReformerLM
    from service.engine.runner import ModelRunner
    from tests.model.helpers import tiny_config

    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        torch.manual_seed(0)
        lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3)).eval()
        prompts = [[5, 6, 7, 8, 9, 10, 11], *([[20 + i, 30, 40 + i] for i in range(5)])]

        def run(rows: int, invariant: bool) -> list[torch.Tensor]:
            runner = ModelRunner(lm, torch.device("cpu"), 8, 64 << 20, invariant=invariant)
            logits, states = runner.prefill(prompts[:1], [40])  # prompts prefilled alone, as invariant mode does
            for p in prompts[1:rows]:
                states += runner.prefill([p], [40])[1]
            tokens = [int(logits[0].argmax())] + [7] * (rows - 1)
            out = []
            for _ in range(6):
                step = runner.decode(tokens, states)
                out.append(step[0])
                tokens = [int(row.argmax()) for row in step]
            assert runner.last_rows_per_call == rows  # one call: no 16-row blocks
            return out

        alone, batched = run(1, True), run(6, True)
        assert all(torch.equal(a, b) for a, b in zip(alone, batched))
        bucketed = run(6, False)
        assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(alone, bucketed))
    finally:
        torch.set_num_threads(before)


def test_small_prefills_run_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.decoding.prefill_threads: a prefill of at most SINGLE_THREAD_PREFILL_TOKENS padded tokens runs on
    one intra-op thread, a larger one on every thread, and the count is restored after."""
    import service.engine.runner as runner_module
    from model import ReformerLM
    from model.decoding import SINGLE_THREAD_PREFILL_TOKENS
    from service.engine.runner import ModelRunner
    from tests.model.helpers import tiny_config

    seen: list[int] = []
    real = runner_module.prefill

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "prefill", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lm = ReformerLM(tiny_config(vocab_size=258)).eval()
        runner = ModelRunner(lm, torch.device("cpu"), 4, 512 << 20)
        for state in runner.prefill([[5] * 30, [6] * 12], [40, 40])[1]:
            runner.free(state)
        n = SINGLE_THREAD_PREFILL_TOKENS // 3 + 1  # three prompts of n: past the limit
        for state in runner.prefill([[7] * n] * 3, [n + 1] * 3)[1]:
            runner.free(state)
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_sampling_after_a_model_call_runs_on_one_thread(artifact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """model.decoding.sampling_threads: the batch's greedy choices and each row's own sampling, after a prefill
    and after every decode step, run on one intra-op thread (a few-microsecond op on two threads costs an
    OpenMP hand-off far larger than itself), and the count is restored after."""
    import service.engine.generation_steps as steps_module

    greedy_threads: list[int] = []
    sample_threads: list[int] = []
    real_greedy, real_accept = steps_module.greedy_choices, GenerationJob.accept

    def greedy(logits: torch.Tensor) -> Any:
        greedy_threads.append(torch.get_num_threads())
        return real_greedy(logits)

    def accept(self: GenerationJob, logits: Any, choice: Any = None) -> Any:
        sample_threads.append(torch.get_num_threads())
        return real_accept(self, logits, choice)

    monkeypatch.setattr(steps_module, "greedy_choices", greedy)
    monkeypatch.setattr(GenerationJob, "accept", accept)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    e = _engine(artifact)
    e.start()
    try:
        sampled = GenerationSpec(prompt_ids=[5, 6, 7], sampling=SamplingParams(do_sample=True, seed=3),
                                 max_new_tokens=5, stop_on_eos=False)
        out = _run(e, _spec([5, 6, 7], 5), sampled)
        assert all(isinstance(ids, list) and len(ids) == 5 for ids in out)
        assert len(greedy_threads) == 5 and len(sample_threads) == 10  # one prefill and 4 steps; 2 rows each
        assert set(greedy_threads) == set(sample_threads) == {1}
        assert torch.get_num_threads() == 2
    finally:
        e.stop()
        torch.set_num_threads(before)


@pytest.mark.parametrize("debug_memory", [False, True])
def test_start_up_objects_are_frozen_out_of_full_collections_until_stop(artifact: Any, debug_memory: bool) -> None:
    import gc

    gc.unfreeze()
    engine = Engine(artifact.model, artifact.tokenizer, backend=None,  # type: ignore[arg-type]
                    device=None, config=EngineConfig(warmup=False), metrics=ServiceMetrics(debug_memory=debug_memory))
    engine.start()
    try:
        assert engine.ready.wait(30)
        # the debug view walks gc.get_objects(), which leaves frozen objects out: then nothing is frozen
        assert (gc.get_freeze_count() == 0) is debug_memory
    finally:
        engine.stop()
    assert gc.get_freeze_count() == 0
