"""A decode step's facts of its rows, host-known, one int64 each in the columns `abi.Meta` names (the C kernels
read them by the same names): `row_facts` for a step's rows, `position_facts` for the consecutive positions
of one request that an extend processes together (model/decoding/extend.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..kernels.abi import Meta
from .cache_state import DecodeState
from .plan import first_lsh_layer

if TYPE_CHECKING:
    from ..reformer import ReformerLM
    from .cache import DecodeCache


def row_facts(lm: ReformerLM, cache: DecodeCache, states: Sequence[DecodeState]
               ) -> tuple[list[list[int]], list[int | list[int] | None]]:
    """Each row's host-known facts (every LSH layer shares its chunk and bucket-count rule, every local layer its
    chunk): slot, position, LSH hashed, LSH chunks, local dense, the slot whose LSH index the row appends to
    (the scratch slot when it keeps none) and whether it keeps one; and each row's bucket count (None: none)."""
    cfg = lm.config
    lsh_c, local_c = cfg.lsh_attn_chunk_length, cfg.local_attn_chunk_length
    first_lsh = first_lsh_layer(cfg)
    nbs = [None if first_lsh is None else s.num_buckets[first_lsh] for s in states]
    rows_meta = []
    for s, nb in zip(states, nbs, strict=True):
        cache.check_writable(s, s.length - 1)  # shared blocks are read-only (DecodeCache.fork)
        p = cfg.padded_length(s.length + 1)
        rows_meta.append([s.slot, s.length, int(p > lsh_c), max(p // lsh_c, 1), int(p <= local_c),
                          s.slot if nb is not None else cache.scratch_slot, int(nb is not None)])
    return rows_meta, nbs


def position_facts(lm: ReformerLM, cache: DecodeCache, state: DecodeState, rows: int) -> Tensor:
    """The facts (rows, abi.Meta columns) int64 of the decode steps of `state` at positions state.length ..
    + rows - 1 (model/decoding/extend.py's rows), worked out together: the first row's as `row_facts` builds
    them, the position-dependent columns (hashed, LSH chunks, local dense) for each position as `row_facts`
    does, from the padded length (config.padded_length) of t + 1."""
    cfg = lm.config
    lsh_c, local_c = cfg.lsh_attn_chunk_length, cfg.local_attn_chunk_length
    lengths = cfg.chunk_lengths()
    lcm = math.lcm(*lengths)
    n = torch.arange(state.length + 1, state.length + rows + 1)  # t + 1
    padded = torch.where((n % lcm == 0) | (n <= min(lengths)), n, n + lcm - n % lcm)
    meta = torch.tensor(row_facts(lm, cache, [state])[0][0], dtype=torch.int64).repeat(rows, 1)
    meta[:, Meta.POSITION] = n - 1
    meta[:, Meta.HASHED] = (padded > lsh_c).long()
    meta[:, Meta.LSH_CHUNKS] = (padded // lsh_c).clamp(min=1)
    meta[:, Meta.LOCAL_DENSE] = (padded <= local_c).long()
    return meta


__all__ = ["position_facts", "row_facts"]
