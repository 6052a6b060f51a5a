"""Whatever the caches hold, an answer is the answer of its request alone on a server with the prefix cache off,
bit for bit (sampled tokens and logprobs): a property over random runs of questions about two documents on a
decode cache with room for about one and a half requests. Between them the run sends questions one at a time or
together, repeats a prompt, ends the kept prefixes (the memory budget's trim) or empties the prefix cache's
memory tier, so a question meets every state the caches can be in: nothing kept, a kept state at or past the
document's end (cut back, once or again), a live request or a kept prefix to share blocks with, or a kept
prefix another request's blocks took."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from model.sampling import SamplingParams
from service.jobs import GenerationSpec

from .test_shared_prefix import _all_back, _engine
from .test_shared_prefix import _together as together

DOCS = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(40 + n)).tolist() for n in (1400, 1100)]
# question lengths: some end before the document's next block boundary, some past it (their kept state is cut
# back for the next question), one past two
QUESTION_LENGTHS = (4, 30, 140, 300, 600)


def _plan(seed: int) -> list[tuple[list[GenerationSpec], str]]:
    """Rounds of (requests sent together, what happens to the caches after them)."""
    rng = random.Random(seed)
    rounds: list[tuple[list[GenerationSpec], str]] = []
    previous: list[GenerationSpec] = []
    for _ in range(12):
        specs = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            if previous and rng.random() < 0.15:
                specs.append(rng.choice(previous))  # the same request again
                continue
            doc = rng.choice(DOCS)
            question = [rng.randrange(3, 250) for _ in range(rng.choice(QUESTION_LENGTHS))]
            specs.append(GenerationSpec(prompt_ids=doc + question,
                                        sampling=SamplingParams(do_sample=True, seed=rng.randrange(1000)),
                                        max_new_tokens=rng.choice((1, 4, 12)), stop_on_eos=False))
        previous = specs
        rounds.append((specs, rng.choice(("nothing", "nothing", "nothing", "drop_kept", "clear_memory"))))
    return rounds


def _run(engine: Any, rounds: list[tuple[list[GenerationSpec], str]]) -> list[Any]:
    answers: list[Any] = []
    for specs, then in rounds:
        answers += together(engine, specs)
        with engine._cond:  # the worker waits for work under this lock: the caches change between its turns
            if then == "drop_kept":
                engine.generations.reuse.drop_kept()
            elif then == "clear_memory" and engine.prefix_cache is not None:
                engine.prefix_cache.store.clear()
    return answers


@pytest.mark.parametrize("seed", range(4))
def test_answers_equal_alone_whatever_the_caches_hold(artifact: Any, seed: int) -> None:
    rounds = _plan(seed)
    cold_engine = _engine(artifact, cache=False)
    cold_engine.start()
    try:
        cold = _run(cold_engine, [([spec], "nothing") for specs, _ in rounds for spec in specs])
    finally:
        cold_engine.stop()
    probe = cold_engine.runner.cache
    one = -(-(max(len(d) for d in DOCS) + max(QUESTION_LENGTHS) + 12) // probe.block_size)
    room = (3 * one // 2 + 8) * probe.bytes_per_block + 4 * probe.reserved_bytes_per_slot
    engine = _engine(artifact, cache_bytes=room, max_batch_size=3)
    engine.start()
    try:
        warm = _run(engine, rounds)
        shared = engine.metrics.prefix_cache.shared_blocks._value.get()  # type: ignore[union-attr]
        hits = sum(engine.metrics.prefix_cache.hits.labels(t)._value.get()  # type: ignore[union-attr]
                   for t in ("memory", "disk"))
    finally:
        engine.stop()
    assert warm == cold
    assert hits > 0 and shared > 0  # the run did meet kept states and shared blocks
    _all_back(engine)
