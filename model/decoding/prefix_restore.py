"""Restoring a kept decode state truncated to its first b positions (b a multiple of PREFIX_BLOCK): one snapshot
of a long prompt serves every later prompt that shares only its first b tokens.

A decode step at position p attends a window that is a pure function of positions <= p, so a state built by
processing tokens one causal step at a time is, after b tokens, a pure function of those b tokens. What the
snapshot at length L holds covers most of that state at b:

- an LSH layer's keys, values and key factors of positions 0..b-1 are its rows [0, b), except one value: a
  successor-value head's slot of row s holds v[s+1], written by the step after s (model/lsh/successor.py), so
  row b-1's holds v[b] at L and 0 at b;
- an LSH layer's bucket order at b: every position's bucket (per head and round) is read back from the
  snapshot's sorted orders and counts (a sorted index j lies in the bucket whose count prefix first exceeds
  j), and positions 0..b-1 are sorted again by (bucket, position) with the index's own build (a counting sort;
  no float arithmetic): the order the state at b holds once its recent order is merged, the recent order
  empty. Where the main/recent split lies never changes a window (model/decoding/lsh_index.py), so the
  restored state steps as the state at b does; its next merge is simply `recent` steps after b.

Reading every position's bucket back and sorting again is most of a truncation's time (about 25 ms a layer at
65,024 positions on the shipped model, two cores). The snapshot keeps the orders and counts its last truncation
built (`StateSnapshot.cut`), so the next truncation to the same boundary (the third question about a document
whose first question's kept state lies past the document's end) copies them: the same bits, as a plain restore
copies a snapshot's orders.

What it does not cover is a local layer's ring: it holds only the last `width` positions
(model/decoding/local_ring.py). So whoever processes the prompt keeps, as the state passes each boundary b
(`BlockTails.keep`, when `state.length % PREFIX_BLOCK == 0`), the slot's whole ring then (exactly positions
[b - width, b) once b >= width), the logits after b if it has them, and the facts a truncation checks
(`TailFacts`); `BlockTails.attach` hands them to the snapshot taken at the end, as tensors
"tail.<b>.ring.<layer>" and "tail.<b>.logits" and its `tails`, so they travel (and are counted) with it.

On the shipped model (two local layers of window 128, 4 heads of 32, float32) a tail is 2 x 128 x 4 x 2 x 32
x 4 bytes = 256 KiB per 256 positions: 1,024 bytes per position kept, plus 258 x 4 bytes of logits per block
(~4 bytes per position); the snapshot itself holds 2,144 bytes per position (two LSH layers' keys and values
1,024, key factors 16 and bucket order 32 each).

What cannot be truncated exactly is refused (ValueError): a boundary whose tail was not kept, an automatic
bucket count that changed between b and L (the rebuild at the change hashed every key again), buckets hashed
ahead at b (model/decoding/rehash_ahead.py: slices the snapshot does not keep). Exact also assumes the kept
state was processed causally through b (decode steps, or an extend that computes what they compute): a
prompt run through the full-forward prefill in one piece never passes b as a state and keeps no tails."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cache import DecodeCache, flat_buckets
from .cache_state import DecodeState
from .lsh_index import LSHIndex
from .snapshot import PREFIX_BLOCK, StateSnapshot, TailFacts, check_fits, ring_rows, shared_positions

if TYPE_CHECKING:
    from ..config import ReformerConfig

__all__ = ["PREFIX_BLOCK", "BlockTails", "position_buckets", "restore_prefix"]


class BlockTails:
    """What a request's processing keeps at each PREFIX_BLOCK boundary it passes, until its snapshot is taken."""

    def __init__(self) -> None:
        self.facts: dict[int, TailFacts] = {}
        self.tensors: dict[str, Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def keep(self, cache: DecodeCache, state: DecodeState, logits: Tensor | None = None) -> None:
        """Keep the tail of `state` (and the logits (vocab,) after its last position, if given) at its length,
        a multiple of PREFIX_BLOCK: after the step that wrote position length - 1, before the next one."""
        b = state.length
        if state.slot < 0 or b <= 0 or b % PREFIX_BLOCK:
            raise ValueError(f"a tail is kept at a multiple of {PREFIX_BLOCK} positions of a held state; "
                             f"got length {b}")
        ahead = state.slot in cache.hashed_ahead
        self.facts[b] = TailFacts(list(state.num_buckets), ahead)
        if ahead:
            return  # refused at restore anyway: its rings would be bytes kept for nothing
        for li, index in enumerate(cache.indexes):
            if index is None:
                self.tensors[f"tail.{b}.ring.{li}"] = cache.kv[li][ring_rows(cache, state.slot)].clone()
        if logits is not None:
            self.tensors[f"tail.{b}.logits"] = logits.detach().to("cpu", torch.float32).clone()

    @classmethod
    def of_snapshot(cls, snap: StateSnapshot, upto: int) -> BlockTails:
        """The tails `snap` holds at boundaries up to `upto`: what a request restored from it at `upto` passed
        without processing (its own snapshot, taken later, carries them on)."""
        tails = cls()
        tails.facts = {b: f for b, f in snap.tails.items() if b <= upto}
        tails.tensors = {name: t for name, t in snap.tensors.items()
                         if name.startswith("tail.") and int(name.split(".")[1]) <= upto}
        return tails

    def attach(self, snap: StateSnapshot) -> None:
        """Hand the tails at boundaries up to the snapshot's length to `snap` (its `tails` and tensors)."""
        for b, facts in self.facts.items():
            if b > snap.length:
                continue
            snap.tails[b] = facts
            snap.tensors.update({name: t for name, t in self.tensors.items() if name.startswith(f"tail.{b}.")})


def _check_prefix(cache: DecodeCache, snap: StateSnapshot, state: DecodeState, length: int) -> TailFacts:
    """ValueError when `snap` cannot be restored into `state` truncated to `length` exactly; else its tail facts."""
    check_fits(cache, snap)
    if length <= 0 or length % PREFIX_BLOCK or length > snap.length:
        raise ValueError(f"a snapshot of {snap.length} positions is truncated to a positive multiple of "
                         f"{PREFIX_BLOCK} up to its length; got {length}")
    shared_positions(cache, state, length)
    facts = snap.tails.get(length)
    if facts is None:
        raise ValueError(f"the snapshot kept no tail at {length} positions")
    if facts.ahead:
        raise ValueError(f"buckets were hashed ahead at {length} positions: the snapshot does not keep them")
    if [str(nb) for nb in facts.num_buckets] != [str(nb) for nb in snap.num_buckets]:
        raise ValueError(f"the bucket count changed between {length} and {snap.length} positions "
                         f"({facts.num_buckets} -> {snap.num_buckets})")
    for li, index in enumerate(cache.indexes):
        ring = snap.tensors.get(f"tail.{length}.ring.{li}")
        want = cache.kv[li][ring_rows(cache, 0)]
        if index is None and (ring is None or ring.shape != want.shape or ring.dtype != want.dtype):
            raise ValueError(f"the snapshot's tail at {length} holds no ring of layer {li} that fits this cache")
    return facts


def position_buckets(index: LSHIndex, snap: StateSnapshot, layer: int) -> Tensor:
    """Every position's bucket (H, R, snap.length) int64 in LSH `layer`, read back from the snapshot's main
    order (sorted indices 0..index_len-1) and recent order (the rest) with their counts: sorted index j of a
    part lies in the first bucket whose inclusive count prefix exceeds j. ValueError when the parts do not
    hold every position exactly once."""
    _, heads, rounds = index.shape
    hr, total, main_len = heads * rounds, snap.length, snap.index_len[layer]
    recent_len = total - main_len
    main_counts = snap.tensors[f"main_counts.{layer}"].reshape(hr, -1).long()  # (HR, NB)
    device = main_counts.device
    recent_counts = snap.tensors[f"recent_counts.{layer}"].reshape(hr, -1).long()  # (HR, NB)
    if recent_len > index.recent_size or not (bool((main_counts.sum(-1) == main_len).all())
                                              and bool((recent_counts.sum(-1) == recent_len).all())
                                              and bool((main_counts >= 0).all()) and bool((recent_counts >= 0).all())):
        raise ValueError(f"layer {layer}'s bucket counts do not add up to its positions")
    main = snap.tensors[f"order.{layer}"].t().long().sub_(index.shift)  # (HR, main_len): positions, sorted
    recent = snap.tensors[f"recent.{layer}"].reshape(hr, -1)[:, :recent_len].long().sub_(index.shift)  # (HR, n)
    if main.shape != (hr, main_len) or recent.shape != (hr, recent_len):
        raise ValueError(f"layer {layer}'s bucket order does not hold every position once")
    out = torch.full((hr, total), -1, dtype=torch.long, device=device)
    for positions, counts in ((main, main_counts), (recent, recent_counts)):
        n = positions.shape[1]
        if not n:
            continue
        low, high = torch.aminmax(positions)  # one pass
        if int(low) < 0 or int(high) >= total:
            raise ValueError(f"layer {layer}'s bucket order holds a position outside 0..{total - 1}")
        # sorted index j's bucket, row by row: each bucket's number repeated its count times (the counts of a
        # row add up to n, checked above)
        nb = counts.shape[1]
        bucket = torch.repeat_interleave(torch.arange(nb, device=device).repeat(hr), counts.reshape(-1))
        out.scatter_(1, positions, bucket.view(hr, n))
    # every row wrote exactly `total` entries (main_len + recent_len), each inside 0..total-1: none left at -1
    # means each position was written once
    if not bool((out >= 0).all()):
        raise ValueError(f"layer {layer}'s bucket order does not hold every position once")
    return out.view(heads, rounds, total)  # (H, R, L)


def restore_prefix(cache: DecodeCache, config: ReformerConfig, snap: StateSnapshot, state: DecodeState,
                   length: int) -> Tensor | None:
    """Write `snap` truncated to its first `length` positions into `state`, freshly allocated (length 0) with
    room for them: what `length` causal steps from an empty state leave, with the recent order merged (see
    the module docstring). `config` is the model's (its successor-value heads). Returns the logits after
    position length - 1 when the tail kept them, else None. A state whose first `state.shared` blocks were shared
    from a live state (`DecodeCache.share_prefix`) gets the keys, values and key factors after them only, as
    `restore_snapshot`."""
    facts = _check_prefix(cache, snap, state, length)
    # the orders the last truncation to this boundary built, if it was to this one (`StateSnapshot.cut`)
    built = snap.cut[1] if snap.cut is not None and snap.cut[0] == length else {}
    # every layer's buckets read back before anything is written: a snapshot they refuse leaves the state empty
    buckets = {li: position_buckets(index, snap, li)[:, :, :length].to(cache.device)  # (H, R, length)
               for li, index in enumerate(cache.indexes)
               if index is not None and facts.num_buckets[li] is not None and li not in built}
    start = shared_positions(cache, state, length)  # rows held with a live state (DecodeCache.share_prefix)
    rows = cache.slot_rows(state, start, length)  # (length - start,)
    for li, index in enumerate(cache.indexes):
        if index is None:
            cache.kv[li][ring_rows(cache, state.slot)] = snap.tensors[f"tail.{length}.ring.{li}"].to(cache.device)
            continue
        norms = cache.norms[li]
        assert norms is not None
        cache.kv[li].index_copy_(0, rows, snap.tensors[f"kv.{li}"][start:length].to(cache.device))
        norms.index_copy_(0, rows, snap.tensors[f"norms.{li}"][start:length].to(cache.device))
        successor = config.successor_heads(li)
        if successor:  # row length-1's successor slots hold v[length], written by a step after the prefix
            cache.values[li][rows[-1:], :successor] = 0
        index.recent[state.slot] = index.shift  # position 0 in every item, as a fresh index holds
        nb = facts.num_buckets[li]
        if nb is None:  # not hashing yet (an automatic count): no index to build
            index.main_counts[state.slot] = 0
            index.recent_counts[state.slot] = 0
            continue
        index.grow_buckets(max(flat_buckets(nb), snap.tensors[f"main_counts.{li}"].shape[-1]))
        order_rows = cache.order_rows(state, 0, length)
        if li in built:  # the same bits the build below gave the last time: copied
            order, counts = built[li]
            index.order.index_copy_(0, order_rows, order)
            index.main_counts[state.slot] = counts
            index.recent_counts[state.slot] = 0
            continue
        index.build(state.slot, order_rows, buckets[li], kernel=cache.kernel)
        built[li] = (index.order[order_rows].clone(), index.main_counts[state.slot].clone())  # (length, H*R)
    snap.cut = (length, built)
    state.length = length
    state.num_buckets = list(facts.num_buckets)
    state.index_len = [0 if ix is None or nb is None else length
                       for ix, nb in zip(cache.indexes, facts.num_buckets, strict=True)]
    cache.hashed_ahead.pop(state.slot, None)
    logits = snap.tensors.get(f"tail.{length}.logits")
    return None if logits is None else logits.clone()
