"""Keeping each request's LSH indexes right as it grows: building one from a prompt's keys, merging the recent
order into the main one every RECENT steps, rebuilding for an automatic bucket count that changes with the
length, and hashing ahead of such a change (model/decoding/rehash_ahead.py)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from ..attention import AttentionContext, LSHSelfAttention
from . import rehash_ahead
from .cache import DecodeCache, flat_buckets
from .cache_state import DecodeState
from .plan import layer_plan

if TYPE_CHECKING:
    from ..config import ReformerConfig
    from ..reformer import ReformerLM

# An LSH index is built with one sort of all heads when they hold at most this many (head, position) pairs
# (a piece of 1.5 ms at 16K pairs, shipped model, one thread, timed by hand), one sort per head past it. Per head, the
# builds were 7% of a 256-token prompt's prefill; all heads at once took them from 1.05 to 0.77 ms for one
# such prompt and from 7.4 to 3.7 ms for eight prefilled together (scratch timing, load not recorded).
INDEX_BUILD_ITEMS = 16384


def index_buckets(att: LSHSelfAttention, padded: int) -> int | list[int] | None:
    """The bucket count a row of this padded length hashes with, or None while it attends densely and the
    model has no fixed count (its index is built when it first hashes)."""
    if att.config.num_buckets is not None:
        return att.config.num_buckets
    return att.num_buckets_for(padded) if padded > att.chunk else None



def row_buckets(att: LSHSelfAttention, buckets: Tensor | None, ctx: AttentionContext, row: int,
                 nb: int | list[int]) -> Tensor | None:
    """Row `row`'s buckets (H, R, L) from the prefill attention's hash of the batch, when that hash used the
    count `nb` the row's index is built with (attention._hash_rows: the fixed count, or the row's own), else
    None."""
    if buckets is None:
        return None
    fixed = att.config.num_buckets
    used = fixed if fixed is not None else att.num_buckets_for(int(ctx.own_length[row]))
    return buckets[row] if str(used) == str(nb) else None


def build_index_steps(cache: DecodeCache, layer: int, att: LSHSelfAttention, state: DecodeState,
                       keys: Tensor | None, nb: int | list[int], buckets: Tensor | None = None
                       ) -> Generator[None, None, None]:
    """(Re)build a request's LSH index of one layer from its keys (H, L, D): one full hash (or its `buckets`
    (H, R, L) already hashed with `nb`; then `keys` may be None), then one sort of every head at once for a
    prompt of at most INDEX_BUILD_ITEMS (head, position) pairs, else one per head, yielding after each (a
    60K-token prompt's sort of every head at once is a ~200 ms piece)."""
    index = cache.indexes[layer]
    assert index is not None
    index.grow_buckets(flat_buckets(nb))
    if buckets is None:
        assert keys is not None
        buckets = att.hash(keys.unsqueeze(0), nb, None)[0]  # (H, R, L)
    length = buckets.shape[-1]
    rows = cache.order_rows(state, 0, length)  # where its main order's sorted indices 0..length-1 live
    yield
    heads = buckets.shape[0]
    group = heads if heads * length <= INDEX_BUILD_ITEMS else 1
    for h in range(0, heads, group):
        index.build(state.slot, rows, buckets[h : h + group], heads=slice(h, h + group), kernel=cache.kernel)
        yield
    state.num_buckets[layer] = nb
    state.index_len[layer] = length


def build_index(cache: DecodeCache, layer: int, att: LSHSelfAttention, state: DecodeState,
                 keys: Tensor | None, nb: int | list[int], buckets: Tensor | None = None) -> None:
    """`build_index_steps` in one go."""
    for _ in build_index_steps(cache, layer, att, state, keys, nb, buckets):
        pass


def _slot_rows(cache: DecodeCache, state: DecodeState, length: int) -> Tensor:
    """Pool rows (length,) of a request's positions 0..length-1."""
    return cache.slot_rows(state, 0, length)


def maintain_indexes(lm: ReformerLM, cache: DecodeCache, states: Sequence[DecodeState]) -> None:
    """Before a step, per row (host-known, rare): an automatic bucket count that changes with the length (or
    a row that starts hashing) rebuilds that row's index from its cached keys, O(L) once; a recent order that
    is full is merged into the main order (model/decoding/lsh_index.py), O(L) every RECENT steps. Every LSH layer
    shares the bucket-count rule, so the count is worked out once per row, not once per row and layer."""
    lsh = [(li, att) for li, p in enumerate(layer_plan(lm)) if isinstance(att := p.attention, LSHSelfAttention)]
    if not lsh:
        return
    for state in states:
        nb = index_buckets(lsh[0][1], lm.config.padded_length(state.length + 1))
        rows: Tensor | None = None  # the row's pool rows for a rebuild, looked up once for all its layers
        rebuilt = False
        for li, att in lsh:
            index = cache.indexes[li]
            assert index is not None
            rebuild = att.config.num_buckets is None and nb is not None and nb != state.num_buckets[li]
            merge = state.num_buckets[li] is not None and state.length - state.index_len[li] >= index.recent_size
            if not (rebuild or merge):
                continue
            if rebuild:
                assert nb is not None
                rows = _slot_rows(cache, state, state.length) if rows is None else rows
                rebuilt = True
                hashed = rehash_ahead.take(cache, state, li, att, nb, rows)
                keys = None if hashed is not None else cache.keys[li].index_select(0, rows).transpose(0, 1)
                build_index(cache, li, att, state, keys, nb, hashed)  # keys (H, L, D) or buckets (H, R, L)
            else:
                # the rows from the request's order table row: none listed (at 500K positions a list is a 4 MB
                # gather)
                index.merge_in_blocks(state.slot, cache.order_table[state.slot], cache.block_size,
                                      state.index_len[li], state.length - state.index_len[li], cache.kernel)
                state.index_len[li] = state.length
        if rebuilt:
            cache.hashed_ahead.pop(state.slot, None)
        coming = coming_count(lm, cache, state, lsh)
        if coming is not None:  # a count change near: one slice of its hashing now, not all of it in one step
            rehash_ahead.advance(cache, state, lsh, coming)


def coming_count(lm: ReformerLM, cache: DecodeCache, state: DecodeState,
                  lsh: Sequence[tuple[int, LSHSelfAttention]]) -> int | list[int] | None:
    """The automatic bucket count the request changes to within rehash_ahead's lead, else None."""
    if not lsh or lsh[0][1].config.num_buckets is not None:
        return None
    last = min(state.capacity * cache.block_size, lm.config.max_position_embeddings) - 1  # the last it may write
    return _next_count(lsh[0][1], lm.config, state.length,
                       min(rehash_ahead.lead(len(lsh), state.length), last - state.length))


def _next_count(att: LSHSelfAttention, cfg: ReformerConfig, length: int, within: int) -> int | list[int] | None:
    """The automatic bucket count a request of `length` positions changes to first in its next `within` steps,
    or None (a binary search: the count only grows with the length)."""
    def count(n: int) -> str:  # the count of the step that writes position n
        return str(index_buckets(att, cfg.padded_length(n + 1)))

    now = count(length)
    lo, hi = length, length + within
    if within < 1 or count(hi) == now:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) == now else (lo, mid)
    return index_buckets(att, cfg.padded_length(hi + 1))

