"""A request's decode state copied out of the decode cache and back in: what the prefix cache keeps.

A `StateSnapshot` holds everything a request's place in a `DecodeCache` holds (model/decoding/cache.py), as
plain tensors that belong to no slot and no block:

- each LSH layer's keys and values, key factors and main bucket order of positions 0..length-1 (pool rows
  of its blocks), and its slot's bucket counts and recent order (model/decoding/lsh_index.py); the orders
  hold positions, not pool rows, so they mean the same in any slot;
- each local layer's ring (model/decoding/local_ring.py): its rows depend only on the position, so the
  slot's whole ring copies across slots as it is;
- the buckets hashed ahead of a bucket-count change (model/decoding/rehash_ahead.py), if any;
- the length, each layer's bucket count and index length (DecodeState), and the logits after the last
  position (what the first sampled token is drawn from);
- optionally, what the state held at each 256-token boundary it passed that truncating it back to that
  boundary needs (`tails`, tensors "tail.<b>.*"; model/decoding/prefix_restore.py).

`restore_snapshot` writes a snapshot into a state `DecodeCache.allocate` gave: the restored request then
steps exactly as the request the snapshot was taken from would have (same bits: only copies, no
arithmetic; tests/model/decoding/test_snapshot.py). The forks of `n` / `best_of` share their leader's blocks
instead (model/decoding/cache.py `DecodeCache.fork`); a snapshot remains what the prefix cache keeps (and what
forks restore with the engine's `shared_blocks` off).

A successor-value head's slot of the last position is written one step late, by the step after it
(model/lsh/successor.py): a snapshot taken right after a prefill holds 0 there, and each restored copy
writes its own, so nothing written after the snapshot is shared."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .cache import DecodeCache
from .cache_state import DecodeState, HashedAhead

# positions per prefix block: a snapshot that kept tails can be restored truncated to any multiple of this
# (model/decoding/prefix_restore.py)
PREFIX_BLOCK = 256


@dataclass(frozen=True)
class TailFacts:
    """The scalar facts of a state at a 256-token boundary b that a truncation to b checks
    (model/decoding/prefix_restore.py): each layer's bucket count at b, and whether buckets were hashed ahead
    for it then (a state that cannot be rebuilt from the snapshot at its full length)."""

    num_buckets: list[int | list[int] | None]
    ahead: bool


@dataclass
class StateSnapshot:
    """One request's decode state at `length` positions, outside the cache (see the module docstring)."""

    length: int
    num_buckets: list[int | list[int] | None]
    index_len: list[int]
    tensors: dict[str, Tensor]  # named as `_names` gives; the logits after the last position as "logits"
    ahead: int | list[int] | None = None  # the count the buckets "ahead.<layer>.<i>" were hashed for
    meta: dict[str, Any] = field(default_factory=dict)  # the owner's (the prefix cache keeps its key there)
    tails: dict[int, TailFacts] = field(default_factory=dict)  # by boundary b; their tensors "tail.<b>.*"
    # the bucket orders and counts its last truncation to a boundary rebuilt, per LSH layer (boundary, {layer:
    # (order (b, H*R), main counts)}): the next truncation to the same boundary copies them instead of reading
    # every position's bucket back and sorting again (model/decoding/prefix_restore.py). Kept in memory only,
    # never written, and not in `nbytes`: at most 4 bytes per position, head and round of each LSH layer (the
    # engine keeps them on one snapshot at a time: service/engine/prompt_reuse.py).
    cut: tuple[int, dict[int, tuple[Tensor, Tensor]]] | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def logits(self) -> Tensor:
        return self.tensors["logits"]

    def header(self) -> dict[str, str]:
        """The scalar fields as strings (safetensors metadata): `from_header` reads them back."""
        return {"length": str(self.length), "num_buckets": json.dumps(self.num_buckets),
                "index_len": json.dumps(self.index_len), "ahead": json.dumps(self.ahead),
                "meta": json.dumps(self.meta, sort_keys=True),
                "tails": json.dumps({str(b): [f.num_buckets, f.ahead] for b, f in sorted(self.tails.items())})}

    @classmethod
    def from_header(cls, header: dict[str, str], tensors: dict[str, Tensor]) -> StateSnapshot:
        return cls(length=int(header["length"]), num_buckets=json.loads(header["num_buckets"]),
                   index_len=[int(n) for n in json.loads(header["index_len"])], tensors=tensors,
                   ahead=json.loads(header["ahead"]), meta=json.loads(header["meta"]),
                   # files written before tails were kept have none
                   tails={int(b): TailFacts(list(nb), bool(ahead))
                          for b, (nb, ahead) in json.loads(header.get("tails", "{}")).items()})


def _held_rows(cache: DecodeCache, state: DecodeState) -> Tensor:
    """Pool rows (length,) of a request's positions in the block pools."""
    return cache.slot_rows(state, 0, state.length)


def ring_rows(cache: DecodeCache, slot: int) -> slice:
    """The local layers' ring rows of `slot` (model/decoding/local_ring.py): what a snapshot copies whole."""
    width = cache.ring.width
    return slice(slot * width, (slot + 1) * width)


def take_snapshot(cache: DecodeCache, state: DecodeState, logits: Tensor) -> StateSnapshot:
    """A copy of `state` (and the logits (vocab,) after its last position) that no later step changes."""
    if state.slot < 0:
        raise ValueError("a snapshot of a state that holds no slot")
    rows = _held_rows(cache, state)
    out: dict[str, Tensor] = {"logits": logits.detach().to("cpu", torch.float32).clone()}
    for li, index in enumerate(cache.indexes):
        if index is None:
            out[f"ring.{li}"] = cache.kv[li][ring_rows(cache, state.slot)].clone()
            continue
        norms = cache.norms[li]
        assert norms is not None
        out[f"kv.{li}"] = cache.kv[li].index_select(0, rows)  # (L, H, 2, D): keys and values side by side
        out[f"norms.{li}"] = norms.index_select(0, rows)  # (L, H)
        # the main order's sorted indices 0..index_len-1 live at the order rows its order table gives
        order_rows = cache.order_rows(state, 0, state.index_len[li])
        out[f"order.{li}"] = index.order.index_select(0, order_rows)  # (n, H*R)
        out[f"main_counts.{li}"] = index.main_counts[state.slot].clone()  # (H, R, NB)
        out[f"recent_counts.{li}"] = index.recent_counts[state.slot].clone()
        out[f"recent.{li}"] = index.recent[state.slot].clone()  # (H, R, RECENT)
    plan = cache.hashed_ahead.get(state.slot)
    if plan is not None:
        for layer, parts in plan.slices.items():
            for i, part in enumerate(parts):
                out[f"ahead.{layer}.{i}"] = part.clone()
    return StateSnapshot(length=state.length, num_buckets=list(state.num_buckets), index_len=list(state.index_len),
                         tensors=out, ahead=None if plan is None else plan.num_buckets)


def _fit_buckets(counts: Tensor, buckets: int) -> Tensor:
    """Bucket counts (H, R, n) padded with empty buckets to `buckets` (an automatic count grew meanwhile)."""
    extra = buckets - counts.shape[-1]
    return torch.nn.functional.pad(counts, (0, extra)) if extra > 0 else counts


def check_fits(cache: DecodeCache, snap: StateSnapshot) -> None:
    """ValueError naming what differs when the snapshot was not taken from a cache of this layout."""
    for li, index in enumerate(cache.indexes):
        if index is None:
            ring = snap.tensors.get(f"ring.{li}")
            want = cache.kv[li][ring_rows(cache, 0)]
            if ring is None or ring.shape != want.shape or ring.dtype != want.dtype:
                raise ValueError(f"layer {li}'s ring does not match this cache's")
            continue
        kv, order, recent = (snap.tensors.get(f"{name}.{li}") for name in ("kv", "order", "recent"))
        if kv is None or kv.shape != (snap.length, *cache.kv[li].shape[1:]) or kv.dtype != cache.kv[li].dtype:
            raise ValueError(f"layer {li}'s keys and values do not match this cache's")
        if order is None or order.dtype != index.order.dtype or order.shape[1:] != index.order.shape[1:]:
            raise ValueError(f"layer {li}'s bucket order does not match this cache's")
        if recent is None or recent.shape != index.recent.shape[1:]:
            raise ValueError(f"layer {li}'s recent order does not match this cache's")
        if snap.index_len[li] > snap.length or order.shape[0] != snap.index_len[li]:
            raise ValueError(f"layer {li}'s index length does not match its positions")
    if len(snap.index_len) != len(cache.indexes) or len(snap.num_buckets) != len(cache.indexes):
        raise ValueError("the snapshot's layer count differs from this cache's")


def shared_positions(cache: DecodeCache, state: DecodeState, length: int) -> int:
    """How many leading positions of `state`, about to be restored to `length` positions, lie in blocks it
    already shares with a live state (`DecodeCache.share_prefix`): their keys, values and key factors are not
    written again. ValueError unless the state is fresh (length 0) with room for `length` positions and its
    shared blocks, if any, are filled and lie before the block holding position length - 1."""
    k = state.shared
    if state.length != 0 or state.capacity * cache.block_size < length:
        raise ValueError("a snapshot is restored into a new state with room for its positions")
    if k and (k > cache.shared_blocks(length) or any(b < 0 for b in state.blocks[:k])):
        raise ValueError(f"a restore of {length} positions keeps at most {cache.shared_blocks(length)} shared "
                         f"blocks, filled first (DecodeCache.share_prefix); this state shares {k}")
    return k * cache.block_size


def restore_snapshot(cache: DecodeCache, snap: StateSnapshot, state: DecodeState) -> None:
    """Write `snap` into `state`, freshly allocated (length 0) with room for at least `snap.length` positions.
    A state whose first `state.shared` blocks were shared from a live state (`DecodeCache.share_prefix`) gets the
    keys, values and key factors of the positions after them only: the caller vouches that the shared rows hold
    what the snapshot holds there (the same tokens read causally: service/engine/live_prefixes.py)."""
    start = shared_positions(cache, state, snap.length)
    state.length = snap.length
    rows = cache.slot_rows(state, start, snap.length)
    for li, index in enumerate(cache.indexes):
        if index is None:
            cache.kv[li][ring_rows(cache, state.slot)] = snap.tensors[f"ring.{li}"].to(cache.device)
            continue
        norms = cache.norms[li]
        assert norms is not None
        cache.kv[li].index_copy_(0, rows, snap.tensors[f"kv.{li}"][start:].to(cache.device))
        norms.index_copy_(0, rows, snap.tensors[f"norms.{li}"][start:].to(cache.device))
        order = snap.tensors[f"order.{li}"].to(cache.device)
        index.order.index_copy_(0, cache.order_rows(state, 0, order.shape[0]), order)
        main, recent = snap.tensors[f"main_counts.{li}"], snap.tensors[f"recent_counts.{li}"]
        index.grow_buckets(main.shape[-1])
        index.main_counts[state.slot] = _fit_buckets(main.to(cache.device), index.buckets)
        index.recent_counts[state.slot] = _fit_buckets(recent.to(cache.device), index.buckets)
        index.recent[state.slot] = snap.tensors[f"recent.{li}"].to(cache.device)
    state.num_buckets = list(snap.num_buckets)
    state.index_len = list(snap.index_len)
    cache.hashed_ahead.pop(state.slot, None)
    if snap.ahead is not None:
        plan = cache.hashed_ahead[state.slot] = HashedAhead(snap.ahead)
        for name in sorted((n for n in snap.tensors if n.startswith("ahead.")),
                           key=lambda n: tuple(int(p) for p in n.split(".")[1:])):
            layer = int(name.split(".")[1])
            plan.slices.setdefault(layer, []).append(snap.tensors[name].to(cache.device, copy=True))
