"""Bucket-sorted order of every LSH (layer, head, hash round), kept as device tensors for batched decoding.

Decoding appends the newest position, which is always the *last* item of its bucket in the stable
(bucket, position) order (/work/shared/notes/batched-lsh-decode.md). A chunk window around it therefore
holds only tail segments of buckets up to its own (at most (before+1)*c items), head segments of the
buckets after it (at most (after+1)*c items) and, where it wraps into a neighbouring round, tails (or
heads) of that round's extreme buckets. Per (slot, head, round) this keeps:

- `counts` (NB,): positions per bucket;
- `items` (NB, A + T): the first A = (after+1)*c positions of each bucket (fixed once filled), then the
  last T = (before+1)*c as a ring: the item at offset `o` of a bucket sits at `A + o % T` while
  `o >= count - T`. One array, so a window slot is one flat gather whichever part it reads.

Positions are stored as int16 (offset by -32768) when every position fits, else int32: the index is a
sizeable share of the cache bytes per token.

A step is one index_add into the counts, two index_copy into the items, a prefix sum, one `searchsorted`
over all rounds' bucket starts per window slot and one gather, all batched over rows, heads and rounds on
flat views: no Python loop, no multi-tensor advanced indexing. What grows with the length is the bucket
count (2*L/chunk by default): a prefix sum and a binary search over it.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LSHIndex:
    def __init__(self, slots: int, heads: int, rounds: int, buckets: int, head_len: int, tail_len: int,
                 device: torch.device, max_positions: int = 2**31 - 1) -> None:
        self.shape = (slots, heads, rounds)
        self.head_len, self.tail_len = head_len, tail_len
        # positions below 2**16 fit int16 once shifted by -32768: half the bytes of int32
        self.dtype, self.shift = (torch.int16, -32768) if max_positions <= 2**16 else (torch.int32, 0)
        self.counts = torch.zeros(slots, heads, rounds, buckets, dtype=torch.int32, device=device)
        # every item holds a valid position (0 until written): a masked window slot still reads one
        self.items = torch.full((slots, heads, rounds, buckets, head_len + tail_len), self.shift, dtype=self.dtype,
                                device=device)

    @property
    def buckets(self) -> int:
        return self.counts.shape[-1]

    @property
    def width(self) -> int:
        return self.head_len + self.tail_len

    def nbytes_per_slot(self, buckets: int | None = None) -> int:
        """Bytes one slot's index holds now, or would hold with `buckets` buckets."""
        cells = self.counts[0, ..., 0].numel()  # heads x rounds
        per_bucket = cells * (self.counts.element_size() + self.width * self.items.element_size())
        return per_bucket * (self.buckets if buckets is None else max(buckets, self.buckets))

    def grow_buckets(self, buckets: int) -> None:
        """Room for more buckets (an automatic bucket count grew): the new buckets start empty."""
        extra = buckets - self.buckets
        if extra <= 0:
            return
        self.counts = torch.nn.functional.pad(self.counts, (0, extra))
        self.items = torch.nn.functional.pad(self.items, (0, 0, 0, extra), value=self.shift)

    def store(self, positions: Tensor) -> Tensor:
        """Positions as the items array holds them."""
        return (positions + self.shift).to(self.dtype)

    def build(self, slot: int, buckets: Tensor, heads: slice = slice(None)) -> None:
        """Fill `slot` from the buckets (H, R, L) of positions 0..L-1 (one full sort, as the prefill does);
        `heads` names which of the slot's heads `buckets` holds (all by default), so a long prompt's index
        can be built one head at a time."""
        h, r, length = buckets.shape
        nb, a, t, w = self.buckets, self.head_len, self.tail_len, self.width
        device = buckets.device
        pos = torch.arange(length, device=device)
        counts = torch.zeros(h, r, nb, dtype=torch.long, device=device).scatter_add_(
            -1, buckets, torch.ones_like(buckets))
        order = torch.argsort(buckets * length + pos, dim=-1)  # (H, R, L): stable (bucket, position) order
        sb = buckets.gather(-1, order)  # bucket of each sorted slot
        start = counts.cumsum(-1) - counts  # (H, R, NB)
        offset = pos - start.gather(-1, sb)  # (H, R, L): offset of each sorted slot inside its bucket
        items = torch.zeros(h, r, nb * w + 1, dtype=torch.long, device=device)  # last entry: discard
        items.scatter_(-1, torch.where(offset < a, sb * w + offset, nb * w), order)
        keep = offset >= counts.gather(-1, sb) - t
        items.scatter_(-1, torch.where(keep, sb * w + a + offset % t, nb * w), order)
        self.counts[slot, heads] = counts.int()
        self.items[slot, heads] = self.store(items[..., :-1].view(h, r, nb, w))

    def append(self, base: Tensor, buckets: Tensor, value: Tensor, weight: Tensor) -> Tensor:
        """Add a position to bucket `buckets` (B, H, R) of the (slot, head, round) rows `base` (B, H, R, flat
        indices into counts' first three dims); `value` (B*H*R,) is the position as `store` gives it and
        `weight` (B*H*R,) int32 is 1 where the row writes. Rows that must not write point `base` at the
        scratch slot with weight 0 (whatever they write there is never read as a real position). Returns
        the counts (B, H, R, NB) after it."""
        nb, a, t, w = self.buckets, self.head_len, self.tail_len, self.width
        cell = (base * nb + buckets).view(-1)  # (B*H*R,)
        counts = self.counts.view(-1)
        counts.index_add_(0, cell, weight)
        offset = (counts.index_select(0, cell).long() - 1).clamp(min=0)  # the new position's offset in its bucket
        items = self.items.view(-1)
        # past the head segment the head write goes to the scratch slot's first item instead
        junk = (self.shape[0] - 1) * self.shape[1] * self.shape[2] * nb * w
        items.index_copy_(0, torch.where(offset < a, cell * w + offset, junk), value)
        items.index_copy_(0, cell * w + a + floor_mod(offset, t), value)
        return self.counts.view(-1, nb).index_select(0, base.view(-1)).view(*buckets.shape, nb)

    def window(self, base: Tensor, counts: Tensor, buckets: Tensor, geo: WindowGeometry) -> tuple[Tensor, Tensor]:
        """Positions (B, H, R, W) in the chunk window of the newest position of every round, W =
        (before+1+after)*chunk, wrapping through the rounds in the row's own layout (`geo`); and whether each
        slot is padding (past the row's length: its position reads 0)."""
        b, h, r, nb = counts.shape
        prefix = counts.cumsum(-1, dtype=torch.long)  # (B, H, R, NB)
        s = prefix.gather(-1, buckets.unsqueeze(-1)) - 1  # (B, H, R, 1): slot of the newest position
        g = torch.remainder(geo.round_start + floor_div(s, geo.chunk) + geo.offsets,
                            geo.total)  # (B, H, R, Wc): chunk index over all rounds, wrapped
        r2 = torch.div(g, geo.n_chunks, rounding_mode="floor")  # the round each window chunk is in
        slot_pos = ((g - r2 * geo.n_chunks) * geo.chunk).unsqueeze(-1) + geo.in_chunk  # (B, H, R, Wc, C)
        absent = slot_pos > geo.t
        # every round's bucket starts in one sorted row per (row, head), round r keyed by r * 2**32, so one
        # searchsorted finds round r2's bucket of each slot and its flat (round, bucket) index at once
        keyed = (prefix - counts + geo.round_key).view(b, h, r * nb)
        query = (slot_pos + (r2 * _ROUND_KEY).unsqueeze(-1)).view(b, h, -1)  # (B, H, R*Wc*C)
        rb = torch.searchsorted(keyed, query, right=True) - 1  # round r2's first key is <= the query
        offset = query - keyed.gather(-1, rb)  # >= 0: the slot's offset inside its bucket
        cell = base[:, :, :1] * nb + rb  # base[..., 0] is (slot, head, round 0)
        a = self.head_len
        at = cell * self.width + torch.where(offset < a, offset, a + floor_mod(offset, self.tail_len))
        pos = self.items.view(-1).index_select(0, at.view(-1)).view(absent.shape).long() - self.shift
        pos = pos.masked_fill(absent, 0)
        return pos.view(b, h, r, -1), absent.view(b, h, r, -1)


_ROUND_KEY = 2**32  # above any position count


def floor_div(x: Tensor, n: int) -> Tensor:
    """x // n for an int tensor; a shift when n is a power of two (int64 division is ~9x slower per
    element on CPU, timed by hand, 65,536 elements: 130 us against 15 us; a two's-complement shift floors
    negative values too, so the result is the same for every x)."""
    return x >> (n.bit_length() - 1) if n & (n - 1) == 0 else torch.div(x, n, rounding_mode="floor")


def floor_mod(x: Tensor, n: int) -> Tensor:
    """x mod n (the sign of n, as torch.remainder) for an int tensor; a mask when n is a power of two."""
    return x & (n - 1) if n & (n - 1) == 0 else torch.remainder(x, n)


class WindowGeometry:
    """Per-step tensors every LSH layer's `window` shares (all LSH layers have one chunk, window and round
    count): built once per step, not once per layer."""

    def __init__(self, t: Tensor, n_chunks: Tensor, heads: int, rounds: int, chunk: int, before: int,
                 after: int) -> None:
        b = t.shape[0]
        device = t.device
        self.chunk = chunk
        self.n_chunks = n_chunks.view(b, 1, 1, 1)
        self.total = self.n_chunks * rounds
        ar_r = torch.arange(rounds, device=device)
        self.round_start = ar_r.view(1, 1, rounds, 1) * self.n_chunks  # (B, 1, R, 1)
        self.offsets = torch.arange(-before, after + 1, device=device)  # (Wc,)
        self.in_chunk = torch.arange(chunk, device=device)  # (C,)
        self.t = t.view(b, 1, 1, 1, 1)
        self.round_key = ar_r.view(1, 1, rounds, 1) * _ROUND_KEY
