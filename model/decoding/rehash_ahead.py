"""Hashing a request's cached keys for its next automatic bucket count before the step that needs them.

With `num_buckets=None` the bucket count doubles when a request's padded length reaches 32 * 2**k (the
reference's rule, model/attention.py `auto_num_buckets`), and the step that crosses rebuilds every LSH
layer's index of that request from its cached keys: one hash of all L keys, then the sorts. Done in that one
step, a 64K-token request's rebuild stalled every stream batched with it for about two seconds on this
project's 2-core CPU (bench/decode/length_cost.py, the bench config's 6 LSH layers; in a profile of that step
the hash was ~67% and the sorts ~20%, bench/README.md).

The length at which the count changes is known in advance, so each decode step of a request that is close
to one (`lead` positions, enough for its slices at one per step) hashes one slice of `SLICE` cached keys of
one LSH layer with the coming count, and keeps the buckets; a prefill that leaves its request that close
hashes them all before it ends (model/decoding/prefill/, between its own slices). The step that crosses then
hashes only the keys written since the layer's last slice and sorts; a slice is the same
`LSHSelfAttention.hash` of the same keys, so the buckets are the ones one hash of all keys gives, up to the
float rounding a matmul over another number of rows may give a rotated value (the cached decode's hash and
the full forward's differ in the same way already). The buckets kept ahead (the cache's `hashed_ahead`, by
slot) are 4 bytes per position, head and round and LSH layer, outside the decode cache's capacity, until that
step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..attention import LSHSelfAttention
from .cache import DecodeCache
from .cache_state import DecodeState, HashedAhead

# cached keys hashed per step and request while a bucket-count change is near (one LSH layer's, heads
# together): the bench config's 4 heads of 64 with [32, 64] buckets hash 512 keys in 0.95-1.00 ms on one
# thread (timed by hand; 2,048 in ~6.7 ms), added to each of the ~830 steps before a 64K request's change
SLICE = 512
# steps to spare beyond the slices' count: positions written meanwhile are hashed too (a slice once SLICE of
# them are waiting, the rest in the crossing step)
MARGIN = 64


def lead(lsh_layers: int, length: int) -> int:
    """How many positions before a bucket-count change hashing ahead starts for a request of `length`
    positions: one slice per step for every LSH layer's keys, plus MARGIN."""
    return lsh_layers * -(-length // SLICE) + MARGIN


def _hash_positions(cache: DecodeCache, layer: int, att: LSHSelfAttention, rows: Tensor,
                    num_buckets: int | list[int]) -> Tensor:
    """Buckets (H, R, n) int32 of the cached keys at pool rows (n,) of `layer`, hashed with `num_buckets`."""
    keys = cache.keys[layer].index_select(0, rows).transpose(0, 1)  # (H, n, D)
    return att.hash(keys.unsqueeze(0), num_buckets, None)[0].to(torch.int32)


def advance(cache: DecodeCache, state: DecodeState, lsh: Sequence[tuple[int, LSHSelfAttention]],
            num_buckets: int | list[int]) -> bool:
    """One slice: the LSH layer with the fewest of the request's positions hashed for `num_buckets` hashes the
    next SLICE of them; False when there was none to hash (fewer than SLICE left, some hashed: they wait for
    the step that changes the count, which hashes what is left anyway). A plan for another count is dropped
    first."""
    plan = cache.hashed_ahead.get(state.slot)
    if plan is None or str(plan.num_buckets) != str(num_buckets):
        plan = cache.hashed_ahead[state.slot] = HashedAhead(num_buckets)
    layer, att = min(lsh, key=lambda item: plan.hashed(item[0]))
    done = plan.hashed(layer)
    if done and state.length - done < SLICE:
        return False
    rows = cache.slot_rows(state, done, min(done + SLICE, state.length))
    plan.slices.setdefault(layer, []).append(_hash_positions(cache, layer, att, rows, num_buckets))
    return True


def take(cache: DecodeCache, state: DecodeState, layer: int, att: LSHSelfAttention, num_buckets: int | list[int],
         rows: Tensor) -> Tensor | None:
    """For the step that changes the count to `num_buckets`: the buckets (H, R, L) int64 of all the request's
    positions (`rows` (L,)), the ones hashed ahead and the rest now; None when nothing was hashed ahead for
    this count."""
    plan = cache.hashed_ahead.get(state.slot)
    if plan is None or str(plan.num_buckets) != str(num_buckets) or layer not in plan.slices:
        return None
    parts = plan.slices.pop(layer)
    done = sum(int(b.shape[-1]) for b in parts)
    if done < rows.shape[0]:
        parts.append(_hash_positions(cache, layer, att, rows[done:], num_buckets))
    return torch.cat(parts, dim=-1).long()
