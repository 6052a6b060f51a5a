"""What a request holds in the decode cache (model/decoding/cache.py): its state, the buckets hashed ahead for
it, and the refusal when the cache cannot take it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import Tensor


class CacheFull(Exception):
    """Not enough free blocks or slots now; `never` when the request could not fit even in an empty cache."""

    def __init__(self, message: str, never: bool = False) -> None:
        super().__init__(message)
        self.never = never


@dataclass
class DecodeState:
    """One request's place in a `DecodeCache`: its slot, its blocks and its length so far."""

    slot: int
    blocks: list[int]
    length: int = 0
    num_buckets: list[int | list[int] | None] = field(default_factory=list)  # per layer: what its index holds
    index_len: list[int] = field(default_factory=list)  # per layer: positions in its index's main order
    # a fork's (DecodeCache.fork), or a restored state's that shares a live state's prefix (`share_prefix`): its
    # first `shared` blocks are held with that state, read-only; its main order of their positions lives in its
    # own spare order blocks `order_blocks`
    shared: int = 0
    order_blocks: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, eq=False)
class KeptPrefix:
    """The first blocks of a freed request's state, kept in the decode cache for a later request that starts
    with the same tokens to share (model/decoding/block_allocator.py `keep`): they stay free, and stay what the
    request wrote until one of them is handed out again (`DecodeCache.kept_valid`). `length`: the positions the
    request had written, so `blocks` are whole (`DecodeCache.shared_blocks(length)` at least their count)."""

    kept: int  # the allocator's id for it
    blocks: np.ndarray  # int64, in position order
    length: int


@dataclass
class HashedAhead:
    """A request's cached keys hashed so far with the bucket count `num_buckets` it reaches soon (what
    model/decoding/rehash_ahead.py computes, kept per slot until the step that changes the count): per LSH
    layer (indexed as the model's layers), the buckets (H, R, n) int32 of its first positions, slice by slice."""

    num_buckets: int | list[int]
    slices: dict[int, list[Tensor]] = field(default_factory=dict)

    def hashed(self, layer: int) -> int:
        return sum(int(b.shape[-1]) for b in self.slices.get(layer, ()))
