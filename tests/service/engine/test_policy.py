"""The batching policy as a table: no threads, no model, no clock."""

from __future__ import annotations

import pytest

from service.engine.policy import (
    QueuedGeneration,
    QueuedInput,
    another_slice_fits,
    group_by_length,
    pick_embed_batch,
    take_generations,
)


def _q(*sizes: tuple[int, int]) -> list[QueuedGeneration]:
    return [QueuedGeneration(p, c) for p, c in sizes]


def _blocks(capacity: int):  # noqa: ANN202
    return lambda sizes: sum(sizes) <= capacity


@pytest.mark.parametrize("queue,running,max_size,max_tokens,capacity,expected", [
    (_q((10, 20), (10, 20), (10, 20)), 0, 8, 100, 1000, 3),        # everything fits
    (_q((10, 20), (10, 20), (10, 20)), 6, 8, 100, 1000, 2),        # batch-size cap counts the running ones
    (_q((60, 70), (60, 70)), 0, 8, 100, 1000, 1),                  # prompt-token budget per turn
    (_q((500, 600)), 0, 8, 100, 1000, 1),                          # a long prompt alone may exceed it
    (_q((10, 500), (10, 500), (10, 20)), 0, 8, 100, 900, 1),       # the cache holds one; the rest waits
    (_q((10, 950), (10, 20)), 0, 8, 100, 900, 0),                  # head does not fit now: nobody overtakes
    ([], 0, 8, 100, 1000, 0),
])
def test_take_generations(queue: list[QueuedGeneration], running: int, max_size: int, max_tokens: int,
                          capacity: int, expected: int) -> None:
    assert take_generations(queue, running, max_size, max_tokens, _blocks(capacity)) == expected


@pytest.mark.parametrize("lengths,budget,expected", [
    ([5, 100, 6, 90], 200, [[0, 2], [3, 1]]),
    ([5, 100, 6, 90], 1000, [[0, 2, 3, 1]]),
    ([300, 10], 100, [[1], [0]]),
    ([], 100, []),
])
def test_group_by_length(lengths: list[int], budget: int, expected: list[list[int]]) -> None:
    assert group_by_length(lengths, budget) == expected


def test_pick_embed_batch_waits_for_company_then_runs() -> None:
    items = [QueuedInput(10, "mean", 0.0), QueuedInput(12, "mean", 0.001), QueuedInput(11, "last", 0.0)]
    assert pick_embed_batch(items, 0.002, 8, 1000, 0.005) == (None, 0.005)
    assert pick_embed_batch(items, 0.006, 8, 1000, 0.005) == ([0, 1], None)  # same pooling only
    assert pick_embed_batch(items, 0.002, 2, 1000, 0.005) == ([0, 1], None)  # full: runs at once
    assert pick_embed_batch(items, 0.0, 8, 1000, 0.005, flush=True) == ([0, 1], None)
    assert pick_embed_batch([], 0.0, 8, 1000, 0.005) == (None, None)


def test_pick_embed_batch_nearest_lengths_under_the_token_budget() -> None:
    items = [QueuedInput(10, "mean", 0.0), QueuedInput(100, "mean", 0.0), QueuedInput(11, "mean", 0.0)]
    assert pick_embed_batch(items, 1.0, 8, 60, 0.005) == ([0, 2], None)


@pytest.mark.parametrize(("elapsed", "recent", "budget", "fits"), [
    (0.02, [0.01], 0.1, True),
    (0.095, [0.01], 0.1, False),  # the last slice alone would overrun
    (0.03, [0.08, 0.001], 0.1, False),  # a short slice after a long one: the long one predicts the next
    (0.0, [], 0.1, True),
    (0.0, [0.2], 0.1, False),  # slices longer than the budget: one per turn
    (0.05, [0.05], 0.1, True),  # exactly at the budget still fits
])
def test_another_slice_fits_predicts_from_the_longest_recent_slice(elapsed: float, recent: list[float],
                                                                   budget: float, fits: bool) -> None:
    assert another_slice_fits(elapsed, recent, budget) is fits
