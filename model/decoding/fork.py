"""Forks of a decode state: a fresh state that shares a live state's first blocks of keys, values and key factors
(counted among their holders by the cache's BlockAllocator) and copies the rest. Used by `DecodeCache.fork`
(the choices of `n`, identical prompts) and `DecodeCache.share_prefix` (a restored causal prompt sharing a
running request's blocks of its prefix: service/engine/live_prefixes.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cache_state import DecodeState, HashedAhead
from .lsh_index import BlockLookup

if TYPE_CHECKING:
    from .cache import DecodeCache


def fork_state(cache: DecodeCache, parent: DecodeState, child: DecodeState) -> None:
    """Fill `child` (from `allocate(tokens, shared)`, length 0, `shared` at most `shared_blocks(parent.length)`)
    with `parent`'s state, as `restore_snapshot(take_snapshot(parent))` would, but sharing instead of copying
    the parent's first `child.shared` blocks of keys, values and key factors (each block's holders counted:
    `free`). The child gets copies of the rest: the block holding the parent's last position and any after
    it, its main orders (into the child's own order rows: merges rewrite them), its bucket counts and
    recent orders, its local rings, its buckets hashed ahead and its lengths. The child then steps exactly as the
    parent would (same bits: only copies), and writing never touches a shared block (`check_writable`)."""
    k, bs = child.shared, cache.block_size
    if parent.slot < 0 or child.slot < 0 or child.length != 0:
        raise ValueError("a fork goes from a live state into a fresh one")
    if k > cache.shared_blocks(parent.length) or child.capacity * bs < parent.length:
        raise ValueError(f"a fork of a state of {parent.length} positions shares at most "
                         f"{cache.shared_blocks(parent.length)} blocks and needs room for them all; this one "
                         f"shares {k} of {child.capacity}")
    cache.share_prefix(parent, child)  # share_blocks, through the cache (where callers observe it)
    own = torch.arange(k * bs, parent.length, device=cache.device)  # positions in the child's own blocks
    slots = torch.tensor([parent.slot, child.slot], device=cache.device)
    rows = cache.rows(slots, own.view(1, -1).expand(2, -1))  # (2, n)
    ring_width = cache.ring.width
    for li, index in enumerate(cache.indexes):
        if index is None:
            kv = cache.kv[li]
            kv[child.slot * ring_width : (child.slot + 1) * ring_width] = \
                kv[parent.slot * ring_width : (parent.slot + 1) * ring_width]
            continue
        norms = cache.norms[li]
        assert norms is not None
        cache.kv[li].index_copy_(0, rows[1], cache.kv[li].index_select(0, rows[0]))
        norms.index_copy_(0, rows[1], norms.index_select(0, rows[0]))
        n = parent.index_len[li]
        if n:
            at = torch.arange(n, device=cache.device).view(1, -1).expand(2, -1)
            order_rows = BlockLookup(cache.order_table, slots, bs).rows(at)  # (2, n)
            index.order.index_copy_(0, order_rows[1], index.order.index_select(0, order_rows[0]))
        index.main_counts[child.slot] = index.main_counts[parent.slot]
        index.recent_counts[child.slot] = index.recent_counts[parent.slot]
        index.recent[child.slot] = index.recent[parent.slot]
    plan = cache.hashed_ahead.get(parent.slot)
    cache.hashed_ahead.pop(child.slot, None)
    if plan is not None:  # the lists are the child's own (a bucket-count change pops them); tensors never change
        cache.hashed_ahead[child.slot] = HashedAhead(plan.num_buckets,
                                                    {li: list(parts) for li, parts in plan.slices.items()})
    child.length = parent.length
    child.num_buckets = list(parent.num_buckets)
    child.index_len = list(parent.index_len)


def share_blocks(cache: DecodeCache, holder: DecodeState, child: DecodeState) -> None:
    """Point `child`'s first `child.shared` blocks (from `allocate(tokens, shared)`, not filled yet) at
    `holder`'s, which must have written past them (at most `shared_blocks(holder.length)`), and count `child`
    among their holders (`free`). Only keys, values and key factors are shared: the caller fills the rest
    (`fork`, or a restore of the same positions' state: model/decoding/snapshot.py `restore_snapshot`)."""
    k = child.shared
    if holder.slot < 0 or child.slot < 0 or child.length != 0 or any(b >= 0 for b in child.blocks[:k]):
        raise ValueError("blocks are shared from a live state into a fresh one")
    if k > cache.shared_blocks(holder.length):
        raise ValueError(f"a state of {holder.length} positions shares at most "
                         f"{cache.shared_blocks(holder.length)} blocks; asked for {k}")
    child.blocks[:k] = holder.blocks[:k]
    cache.allocator.hold(child.blocks[:k])
    cache.block_table[child.slot, :k] = cache.block_table[holder.slot, :k]
