"""Batching policy: pure functions over plain values that say what joins the next model call. No threads,
no model, no clock of their own (the caller passes `now`), so they are table-tested (tests/service/
test_policy.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedGeneration:
    prompt_tokens: int
    cache_tokens: int  # prompt + max_new_tokens: the decode-cache positions it reserves when it starts


def take_generations(queue: Sequence[QueuedGeneration], running: int, max_batch_size: int, max_batch_tokens: int,
                     fits: Callable[[Sequence[int]], bool]) -> int:
    """How many generations at the head of the queue (FIFO) start now: while the running ones plus them stay
    within `max_batch_size`, their prompts within `max_batch_tokens` (the first one always may, alone), and
    `fits(cache_tokens of all taken)` says the decode cache holds them. A head that does not fit waits, and
    so does everything behind it (no overtaking: a large request is not starved by small ones)."""
    taken, tokens = 0, 0
    for item in queue:
        if running + taken >= max_batch_size:
            break
        if taken and tokens + item.prompt_tokens > max_batch_tokens:
            break
        if not fits([q.cache_tokens for q in queue[: taken + 1]]):
            break
        taken += 1
        tokens += item.prompt_tokens
    return taken


def group_by_length(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of prompts to prefill together: sorted by length, each group's padded size (longest times
    rows) within `max_batch_tokens` (a single longer prompt forms its own group)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > max_batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class QueuedInput:
    tokens: int
    pooling: str
    enqueued: float


def pick_embed_batch(items: Sequence[QueuedInput], now: float, max_batch_size: int, max_batch_tokens: int,
                     max_wait_s: float, flush: bool = False) -> tuple[list[int] | None, float | None]:
    """Indices of the next embedding batch, or (None, when to look again) while it waits for company. The
    oldest input anchors the batch (FIFO fairness); inputs pooled the same way and nearest in length join it
    under `max_batch_size` rows and `max_batch_tokens` padded tokens. A batch runs when full, when its
    anchor has waited `max_wait_s`, or when `flush` (shutting down)."""
    if not items:
        return None, None
    anchor = items[0]
    same = [i for i, it in enumerate(items) if it.pooling == anchor.pooling]
    candidates = sorted(same, key=lambda i: (abs(items[i].tokens - anchor.tokens), i))
    batch: list[int] = []
    longest = 0
    full = False
    for i in candidates:
        new_longest = max(longest, items[i].tokens)
        if batch and (len(batch) + 1 > max_batch_size or new_longest * (len(batch) + 1) > max_batch_tokens):
            full = True
            break
        batch.append(i)
        longest = new_longest
    full = full or len(batch) >= max_batch_size
    ready_at = anchor.enqueued + max_wait_s
    if not full and now < ready_at and not flush:
        return None, ready_at
    return batch, None


# How many of a sliced prefill's latest slice durations predict the next one's.
SLICE_HISTORY = 8


def another_slice_fits(elapsed_s: float, recent_s: Sequence[float], budget_s: float) -> bool:
    """Whether another prefill slice is expected to end within this turn's budget, its cost predicted as the
    longest of the recent slices. A layer's slices cycle through kinds of very different cost (projections
    of the whole prompt, cache writes, per-head index builds, attention and feed-forward slices): predicting
    from the last slice alone overran the budget by a long slice's time whenever a short one preceded it."""
    return elapsed_s + max(recent_s, default=0.0) <= budget_s
