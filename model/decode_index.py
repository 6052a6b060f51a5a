"""Bucket-sorted order of every LSH (layer, head, hash round), kept as device tensors for batched decoding.

Decoding appends the newest position, which is always the *last* item of its bucket in the stable
(bucket, position) order (/work/shared/notes/batched-lsh-decode.md). A chunk window around it therefore
holds only tail segments of buckets up to its own (at most (before+1)*c items), head segments of the
buckets after it (at most (after+1)*c items) and, where it wraps into a neighbouring round, tails (or
heads) of that round's extreme buckets. Per (slot, head, round) this keeps:

- `counts` (NB,): positions per bucket;
- `head` (NB, A): the first A = (after+1)*c positions of each bucket (fixed once filled);
- `tail` (NB, T): the last T = (before+1)*c positions of each bucket, as a ring: the item at offset `o`
  of a bucket sits at `tail[o % T]` while `o >= count - T`.

A step is a scatter-add into the counts, a prefix sum, a `searchsorted` per window slot and gathers, all
batched over rows, heads and rounds: its cost does not depend on the sequence length.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LSHIndex:
    def __init__(self, slots: int, heads: int, rounds: int, buckets: int, head_len: int, tail_len: int,
                 device: torch.device) -> None:
        self.shape = (slots, heads, rounds)
        self.head_len, self.tail_len = head_len, tail_len
        # int32: positions and counts stay below max_position_embeddings; half the bytes of int64
        self.counts = torch.zeros(slots, heads, rounds, buckets, dtype=torch.int32, device=device)
        self.head = torch.zeros(slots, heads, rounds, buckets, head_len, dtype=torch.int32, device=device)
        self.tail = torch.zeros(slots, heads, rounds, buckets, tail_len, dtype=torch.int32, device=device)

    @property
    def buckets(self) -> int:
        return self.counts.shape[-1]

    def nbytes_per_slot(self) -> int:
        return (self.counts[0].numel() + self.head[0].numel() + self.tail[0].numel()) * self.counts.element_size()

    def grow_buckets(self, buckets: int) -> None:
        """Room for more buckets (an automatic bucket count grew): the new buckets start empty."""
        extra = buckets - self.buckets
        if extra <= 0:
            return
        self.counts = torch.nn.functional.pad(self.counts, (0, extra))
        self.head = torch.nn.functional.pad(self.head, (0, 0, 0, extra))
        self.tail = torch.nn.functional.pad(self.tail, (0, 0, 0, extra))

    def build(self, slot: int, buckets: Tensor) -> None:
        """Fill `slot` from the buckets (H, R, L) of positions 0..L-1 (one full sort, as the prefill does)."""
        h, r, length = buckets.shape
        nb, a, t = self.buckets, self.head_len, self.tail_len
        device = buckets.device
        pos = torch.arange(length, device=device)
        counts = torch.zeros(h, r, nb, dtype=torch.long, device=device).scatter_add_(
            -1, buckets, torch.ones_like(buckets))
        order = torch.argsort(buckets * length + pos, dim=-1)  # (H, R, L): stable (bucket, position) order
        sb = buckets.gather(-1, order)  # bucket of each sorted slot
        start = counts.cumsum(-1) - counts  # (H, R, NB)
        offset = pos - start.gather(-1, sb)  # (H, R, L): offset of each sorted slot inside its bucket
        head = torch.zeros(h, r, nb * a + 1, dtype=torch.long, device=device)  # last entry: discard
        head.scatter_(-1, torch.where(offset < a, sb * a + offset, nb * a), order)
        tail = torch.zeros(h, r, nb * t + 1, dtype=torch.long, device=device)
        keep = offset >= counts.gather(-1, sb) - t
        tail.scatter_(-1, torch.where(keep, sb * t + offset % t, nb * t), order)
        self.counts[slot] = counts.int()
        self.head[slot] = head[..., :-1].view(h, r, nb, a).int()
        self.tail[slot] = tail[..., :-1].view(h, r, nb, t).int()

    def append(self, slots: Tensor, buckets: Tensor, t: Tensor, live: Tensor) -> Tensor:
        """Add position t (B,) in buckets (B, H, R) to `slots` (B,) where `live` (B,); returns the counts
        (B, H, R, NB) after it. Rows not live leave their slot unchanged."""
        b, h, r = buckets.shape
        nb, a, tl = self.buckets, self.head_len, self.tail_len
        counts = self.counts[slots].scatter_add(-1, buckets.unsqueeze(-1),
                                                live.int().view(b, 1, 1, 1).expand(b, h, r, 1))
        self.counts[slots] = torch.where(live.view(b, 1, 1, 1), counts, self.counts[slots])
        offset = counts.gather(-1, buckets.unsqueeze(-1)).squeeze(-1).long() - 1  # (B, H, R)
        cell = ((slots.view(b, 1, 1) * h + torch.arange(h, device=slots.device).view(1, h, 1)) * r
                + torch.arange(r, device=slots.device).view(1, 1, r)) * nb + buckets  # (B, H, R)
        value = t.view(b, 1, 1).expand(b, h, r).int()
        live3 = live.view(b, 1, 1).expand(b, h, r)
        head = self.head.view(-1)
        # rows that must not write put back what is there
        head_at = cell * a + offset.clamp(0, a - 1)
        head.index_put_((head_at,), torch.where(live3 & (offset < a), value, head[head_at]))
        tail = self.tail.view(-1)
        tail_at = cell * tl + offset.clamp(min=0) % tl
        tail.index_put_((tail_at,), torch.where(live3, value, tail[tail_at]))
        return counts

    def window(self, slots: Tensor, counts: Tensor, buckets: Tensor, t: Tensor, n_chunks: Tensor, chunk: int,
               before: int, after: int) -> tuple[Tensor, Tensor]:
        """Positions (B, H, R, W) in the chunk window of the newest position t (B,) of every round, W =
        (before+1+after)*chunk, wrapping through the rounds in the row's own layout of n_chunks (B,) chunks
        per round; and whether each slot holds a real position (slots past the row's length are padding)."""
        b, h, r, nb = counts.shape
        device = counts.device
        counts = counts.long()
        prefix = counts.cumsum(-1)  # (B, H, R, NB)
        start = prefix - counts
        s = prefix.gather(-1, buckets.unsqueeze(-1)).squeeze(-1) - 1  # (B, H, R): slot of the newest position
        j = torch.div(s, chunk, rounding_mode="floor")
        offs = torch.arange(-before, after + 1, device=device)  # (Wc,)
        n = n_chunks.view(b, 1, 1, 1)
        g = torch.remainder(torch.arange(r, device=device).view(1, 1, r, 1) * n + j.unsqueeze(-1) + offs, r * n)
        r2, j2 = torch.div(g, n, rounding_mode="floor"), torch.remainder(g, n)  # (B, H, R, Wc)
        slot_pos = j2.unsqueeze(-1) * chunk + torch.arange(chunk, device=device)  # (B, H, R, Wc, C)
        real = slot_pos <= t.view(b, 1, 1, 1, 1)
        bi = torch.arange(b, device=device).view(b, 1, 1, 1)
        hi = torch.arange(h, device=device).view(1, h, 1, 1)
        prefix_r2 = prefix[bi, hi, r2]  # (B, H, R, Wc, NB): the sorted order of the round each chunk is in
        bucket = torch.searchsorted(prefix_r2, slot_pos, right=True).clamp(max=nb - 1)  # (B, H, R, Wc, C)
        offset = slot_pos - start[bi, hi, r2].gather(-1, bucket)
        si, hi5, r5 = slots.view(b, 1, 1, 1, 1), hi.unsqueeze(-1), r2.unsqueeze(-1)
        in_head = self.head[si, hi5, r5, bucket, offset.clamp(0, self.head_len - 1)]
        in_tail = self.tail[si, hi5, r5, bucket, offset.clamp(min=0) % self.tail_len]
        pos = torch.where(offset < self.head_len, in_head, in_tail).long()
        pos = torch.where(real, pos, 0)
        w = slot_pos.shape[3] * chunk
        return pos.reshape(b, h, r, w), real.reshape(b, h, r, w)
