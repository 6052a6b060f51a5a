"""Bucket-sorted order of every LSH (layer, head, hash round), kept as device tensors for batched decoding.

A full forward sorts a request's positions by (bucket, position) in every head and hash round and attends
over chunk windows of that order. Decoding appends the newest position, which is always the *last* item of
its bucket (no earlier position is greater), so the order is kept in two parts:

- the **main order**: every position up to the request's last build or merge, in sorted order, stored in
  the decode cache's blocks beside its keys (sorted index j of (slot, head, round) lives at the pool row
  of (slot, j), column head * rounds + round): 2 bytes per position, head and round (int16 while every
  position fits, else 4), paid for by the blocks the request reserves; and its bucket counts
  `main_counts`;
- the **recent order**: the positions appended since, sorted by (bucket, position), in a fixed array of
  `RECENT` items per (slot, head, round), with their bucket counts `recent_counts`.

Every recent position is later than every main one, so the merged order is, bucket by bucket, the bucket's
main items then its recent items. A step is: one insert into the recent array (every row's array shifted
past the new item's place in one `where`: RECENT items, whatever the prompt length), prefix sums of both
parts' bucket counts, one `searchsorted` over all rounds' merged bucket starts per window slot, and one
gather of every slot's position from the buffer that holds both parts, batched over rows, heads and rounds
on flat views: no Python loop, no host sync. When a request's recent array is full (host-known: RECENT
steps after its last build or merge) it is merged into the main order before the next step: one scatter of
the request's L items per layer, every RECENT steps. What grows with the length is that merge and the
bucket count (2*L/chunk by default: a prefix sum and a binary search over it).

On the CPU cache of a float32 model with the C kernel (model/kernels/) the insert, the window and the
merge run in C on these same tensors; the kernel finds a slot's bucket by walking the counts from the new
position's bucket instead of prefix sums over every bucket, and a merge reads the request's pool rows from
its block table row as it moves the items (`merge_in_blocks`). The methods here are the PyTorch path (GPUs,
models of other dtypes, no compiler) and what the kernel is tested against.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..kernels.bindings import IndexArrays
from ..lsh.order import bucket_order
from .huge_pages import pool_empty

if TYPE_CHECKING:
    from ..kernels import CpuKernels

RECENT = 64  # recent items per (slot, head, round): a merge every RECENT steps; RECENT items per step to shift
MAX_RECENT = 1024  # the most recent items a long cache keeps (its counts are int16)


def recent_size_for(max_tokens: int | None) -> int:
    """The recent order's size for a cache serving requests of up to `max_tokens`: RECENT for short ones, about
    sqrt(max_tokens) (a power of two, at most MAX_RECENT) for long ones. A merge moves every item a request
    holds, so merging every R steps costs about L / R item moves a step, while each step's insert shifts at
    most R: R near sqrt(L) keeps both small (524,288 tokens: R = 1,024, a merge every 1,024 steps instead of
    64). Which items are recent never changes a window (main and recent are read as one order)."""
    if max_tokens is None:
        return RECENT
    root = max(math.isqrt(max(max_tokens, 1)), 1)
    return max(RECENT, min(MAX_RECENT, 1 << (root - 1).bit_length()))


def position_storage(max_positions: int) -> tuple[torch.dtype, int]:
    """The dtype positions are stored as and the shift applied first: below 2**16 positions fit int16 once
    shifted by -32768, half the bytes of int32."""
    return (torch.int16, -32768) if max_positions <= 2**16 else (torch.int32, 0)


class StepCounts(NamedTuple):
    """A step's rows' bucket counts (B, H, R, NB) after its insert, and their inclusive prefix sums."""

    main: Tensor
    recent: Tensor
    main_end: Tensor
    recent_end: Tensor


class LSHIndex:
    def __init__(self, slots: int, heads: int, rounds: int, buckets: int, rows: int, device: torch.device,
                 max_positions: int = 2**31 - 1, recent: int = RECENT) -> None:
        """`slots` request slots (the last one scratch), `rows` the decode cache's pool rows (the main order
        lives there, addressed through the request's blocks)."""
        self.shape = (slots, heads, rounds)
        self.recent_size, self.max_positions = recent, max_positions
        self.dtype, self.shift = position_storage(max_positions)
        self.main_counts = torch.zeros(slots, heads, rounds, buckets, dtype=torch.int32, device=device)
        # at most RECENT items: int16 counts (a sizeable share of a short request's bytes per token)
        self.recent_counts = torch.zeros_like(self.main_counts, dtype=torch.int16)
        # both orders in one buffer, so a window reads each slot's position with one gather from either part.
        # The main order is empty, as the key pools: a step reads only sorted indices below the main length,
        # all written by a build or merge (the scratch block, which padding rows read, is filled by the
        # cache); every recent item holds a valid position (0 until written): a masked slot still reads one
        self.recent_offset = rows * heads * rounds
        self._items = pool_empty((self.recent_offset + slots * heads * rounds * recent,), self.dtype, device)
        self.order = self._items[: self.recent_offset].view(rows, heads * rounds)
        self.recent = self._items[self.recent_offset :].view(slots, heads, rounds, recent)
        self.recent.fill_(self.shift)
        # constants a step uses (made once: an arange per layer and step is a measurable share of a small step)
        self._recent_slots = torch.arange(recent, device=device)
        self._head_columns = torch.arange(heads, device=device).view(1, heads, 1, 1, 1) * rounds
        self.head_offsets = torch.arange(heads, device=device).view(1, heads, 1)  # (1, H, 1)

    @property
    def buckets(self) -> int:
        return self.main_counts.shape[-1]

    @staticmethod
    def token_bytes(heads: int, rounds: int, max_positions: int) -> int:
        """Bytes of the main order per cached position (held in the cache's blocks)."""
        return heads * rounds * position_storage(max_positions)[0].itemsize

    @staticmethod
    def slot_bytes(heads: int, rounds: int, buckets: int, max_positions: int, recent: int = RECENT) -> int:
        """Bytes one request slot holds outside the blocks: two counts per bucket (int32 main, int16 recent)
        and the recent array."""
        return heads * rounds * ((4 + 2) * buckets + recent * position_storage(max_positions)[0].itemsize)

    def nbytes_per_slot(self, buckets: int | None = None) -> int:
        """Bytes one slot's index holds now, or would hold with `buckets` buckets."""
        _, heads, rounds = self.shape
        nb = self.buckets if buckets is None else max(buckets, self.buckets)
        return self.slot_bytes(heads, rounds, nb, self.max_positions, self.recent_size)

    def grow_buckets(self, buckets: int) -> None:
        """Room for more buckets (an automatic bucket count grew): the new buckets start empty."""
        extra = buckets - self.buckets
        if extra <= 0:
            return
        self.main_counts = torch.nn.functional.pad(self.main_counts, (0, extra))
        self.recent_counts = torch.nn.functional.pad(self.recent_counts, (0, extra))

    @property
    def items(self) -> Tensor:
        """The buffer holding both orders (what `window` gathers from)."""
        return self._items

    def arrays(self) -> IndexArrays:
        """The tensors and layout the C kernels read (model/kernels/bindings.py)."""
        return IndexArrays(self.main_counts, self.recent_counts, self._items, self.recent, self.order.shape[0],
                           self.recent_size, self.shift, self.recent_offset)

    def tensors(self) -> tuple[Tensor, ...]:
        """What a step reads and writes (a captured CUDA graph holds their addresses)."""
        return self.main_counts, self.recent_counts, self._items

    def store(self, positions: Tensor) -> Tensor:
        """Positions as the index holds them."""
        return (positions + self.shift).to(self.dtype)

    def build(self, slot: int, rows: Tensor, buckets: Tensor, heads: slice = slice(None),
              kernel: CpuKernels | None = None) -> None:
        """Fill `slot`'s main order from the buckets (H, R, L) of positions 0..L-1 (one full sort, as the
        prefill does) and empty its recent order; `rows` (L,) are the slot's pool rows of positions 0..L-1,
        `heads` which of its heads `buckets` holds (all by default), so a long prompt's index can be built
        one head at a time. With the CPU `kernel` the sort is a counting sort in C, the same order."""
        h, r, length = buckets.shape
        device = buckets.device
        counts = torch.zeros(h, r, self.buckets, dtype=torch.long, device=device).scatter_add_(
            -1, buckets, torch.ones_like(buckets))
        order = bucket_order(buckets, self.buckets, kernel)  # (H, R, L)
        columns = torch.arange(self.shape[1] * r, device=device).view(-1, r)[heads].reshape(-1)  # (H*R,)
        self.order[rows.view(-1, 1), columns.view(1, -1)] = self.store(order.reshape(h * r, length).t())
        self.main_counts[slot, heads] = counts.int()
        self.recent_counts[slot, heads] = 0

    def merge(self, slot: int, rows: Tensor, main_len: int, recent_len: int) -> None:
        """Move `slot`'s recent items into its main order; `rows` (main_len + recent_len,) are its pool rows
        of sorted indices 0.. . In the merged order a main item moves up by the recent items of the buckets
        before its own, a recent item by the main items of its bucket and those before it: two prefix sums of
        counts scattered at the bucket boundaries, then one scatter of every item. (`merge_in_blocks` is the
        same merge with the rows given as a block table row, and the one the C kernel runs.)"""
        self._merge_items(slot, rows, main_len, recent_len)
        self._merge_counts(slot)

    def merge_in_blocks(self, slot: int, table: Tensor, block_size: int, main_len: int, recent_len: int,
                        kernel: CpuKernels | None = None) -> None:
        """`merge` with `slot`'s pool rows given as its block table row `table` (blocks of `block_size`
        positions). With the CPU `kernel` the items move in place in one C pass per (head, round), from the
        last bucket down (model/kernels/), reading the rows from the table as it moves them, so a merge builds
        no list of the request's pool rows (an O(length) gather, then checked, at every merge)."""
        if kernel is None:
            at = torch.arange(main_len + recent_len, device=table.device)
            self.merge(slot, table[floor_div(at, block_size)] * block_size + floor_mod(at, block_size), main_len,
                       recent_len)
            return
        kernel.merge_blocks(self.arrays(), slot, table, block_size, main_len, recent_len)
        self._merge_counts(slot)

    def _merge_counts(self, slot: int) -> None:
        self.main_counts[slot] += self.recent_counts[slot]
        self.recent_counts[slot] = 0

    def _merge_items(self, slot: int, rows: Tensor, main_len: int, recent_len: int) -> None:
        _, heads, rounds = self.shape
        hr, nb, device = heads * rounds, self.buckets, rows.device
        main = self.main_counts[slot].view(hr, nb).long()
        recent = self.recent_counts[slot].view(hr, nb).long()  # (HR, NB)
        old = self.order.index_select(0, rows[:main_len]).t()  # (HR, Lm)
        new = self.recent[slot].view(hr, -1)[:, :recent_len]  # (HR, N)
        # a bucket's items end at its inclusive prefix: the recent items of the buckets ending at or before a
        # main index are those of the buckets before its own
        up_main = torch.zeros(hr, main_len + 1, dtype=torch.long, device=device).scatter_add_(
            1, main.cumsum(-1), recent).cumsum(-1)[:, :main_len]
        # a bucket's recent items start at its exclusive prefix: every bucket starting at or before a recent
        # index is its own or an earlier one
        up_new = torch.zeros(hr, recent_len + 1, dtype=torch.long, device=device).scatter_add_(
            1, recent.cumsum(-1) - recent, main).cumsum(-1)[:, :recent_len]
        merged = torch.empty(hr, main_len + recent_len, dtype=self.dtype, device=device)
        merged.scatter_(1, torch.arange(main_len, device=device) + up_main, old)
        merged.scatter_(1, torch.arange(recent_len, device=device) + up_new, new)
        self.order.index_copy_(0, rows, merged.t().contiguous())

    def append(self, base: Tensor, buckets: Tensor, value: Tensor, weight: Tensor) -> StepCounts:
        """Insert a position into bucket `buckets` (B, H, R) of the recent order of the (slot, head, round)
        rows `base` (B, H, R, flat indices into the counts' first three dims); `value` (B*H*R,) is the
        position as `store` gives it and `weight` (B*H*R,) int16 is 1 where the row writes. Rows that must
        not write point `base` at the scratch slot with weight 0 (what lands there is never read as a real
        position). The caller keeps every real row's recent array below RECENT items (merging first).
        Returns the rows' counts after it, for `window`. (The CPU kernel's `append` does the same insert
        in C, model/kernels/bindings.py.)"""
        nb, size = self.buckets, self.recent_size
        flat = base.reshape(-1)
        bucket = buckets.reshape(-1, 1)
        recent = self.recent_counts.view(-1, nb).index_select(0, flat).scatter_add_(-1, bucket, weight.view(-1, 1))
        recent_end = recent.cumsum(-1)  # (N, NB): after the insert
        # the new item goes after the recent items of every bucket <= its own
        at = recent_end.gather(-1, bucket) - weight.view(-1, 1)  # (N, 1)
        old = self.recent.view(-1, size).index_select(0, flat)  # (N, RECENT)
        shifted = torch.cat([old[:, :1], old[:, :-1]], dim=-1)  # each item moved one place up
        items = torch.where(self._recent_slots < at, old, shifted).scatter_(-1, at, value.view(-1, 1))
        self.recent.view(-1, size).index_copy_(0, flat, items)
        self.recent_counts.view(-1).index_add_(0, flat * nb + bucket.view(-1), weight)
        main = self.main_counts.view(-1, nb).index_select(0, flat)  # (N, NB)
        shape = (*buckets.shape, nb)
        return StepCounts(main.view(shape), recent.view(shape), main.cumsum(-1).view(shape), recent_end.view(shape))

    def window(self, base: Tensor, counts: StepCounts, buckets: Tensor, geo: WindowGeometry,
               orders: BlockLookup) -> tuple[Tensor, Tensor]:
        """Positions (B, H, R, W) in the chunk window of the newest position of every round, W =
        (before+1+after)*chunk, wrapping through the rounds in the row's own layout (`geo`), from the counts
        `append` returned and the rows' order table rows `orders` (where their main orders live); and whether
        each slot is padding (past the row's length: its position reads 0)."""
        main, recent, main_end, recent_end = counts
        b, h, r, nb = main.shape
        size = self.recent_size
        total = main + recent
        prefix = main_end + recent_end  # (B, H, R, NB): merged bucket ends
        s = prefix.gather(-1, buckets.unsqueeze(-1)) - 1  # (B, H, R, 1): slot of the newest position
        g = torch.remainder(geo.round_start + floor_div(s, geo.chunk) + geo.offsets,
                            geo.total)  # (B, H, R, Wc): chunk index over all rounds, wrapped
        r2 = torch.div(g, geo.n_chunks, rounding_mode="floor")  # the round each window chunk is in
        slot_pos = ((g - r2 * geo.n_chunks) * geo.chunk).unsqueeze(-1) + geo.in_chunk  # (B, H, R, Wc, C)
        absent = slot_pos > geo.t
        # every round's bucket starts in one sorted row per (row, head), round r keyed by r * 2**32, so one
        # searchsorted finds round r2's bucket of each slot (its flat (round, bucket) index) at once
        keyed = (prefix - total + geo.round_key).view(b, h, r * nb)
        query = (slot_pos + (r2 * _ROUND_KEY).unsqueeze(-1)).view(b, h, -1)  # (B, H, Q = R*Wc*C)
        rb = torch.searchsorted(keyed, query, right=True) - 1  # round r2's first key is <= the query
        # a merged bucket starts at main_start + recent_start and holds its main items, then its recent
        # ones: slot p reads main index p - recent_start while that is below the bucket's main end, else
        # recent index p - main_end
        recent_start = (recent_end - recent).view(b, h, r * nb).gather(-1, rb).view(slot_pos.shape)
        slot_main_end = main_end.view(b, h, r * nb).gather(-1, rb).view(slot_pos.shape)
        j = slot_pos - recent_start  # sorted index in the main order
        from_main = j < slot_main_end
        k = (slot_pos - slot_main_end).clamp_(0, size - 1)  # sorted index in the recent order
        column = self._head_columns + r2.unsqueeze(-1)  # (B, H, R, Wc, 1): the (head, round) column
        main_at = orders.rows(j.view(b, -1)).view(slot_pos.shape) * (h * r) + column
        # base[..., 0] is (slot, head, round 0)
        recent_at = ((base[:, :, :1, None] + r2) * size + self.recent_offset).unsqueeze(-1) + k
        at = torch.where(from_main, main_at, recent_at)  # into the buffer holding both orders
        pos = self._items.index_select(0, at.view(-1)).view(slot_pos.shape)
        pos = (pos.long() - self.shift).masked_fill_(absent, 0)
        return pos.view(b, h, r, -1), absent.view(b, h, r, -1)


class BlockLookup:
    """Pool rows of positions of a step's rows, from their block table rows: read in place from the cache's
    block table (a flat gather per lookup, no per-step copy of each row's table)."""

    def __init__(self, block_table: Tensor, slots: Tensor, block_size: int) -> None:
        self.flat = block_table.view(-1)
        self.width = block_table.shape[1]
        self.base = (slots * self.width).view(-1, 1)  # (B, 1)
        self.block_size = block_size

    def rows(self, positions: Tensor) -> Tensor:
        """positions (B, N), each below the table's width in positions (the cache's table covers the padded
        length of its longest row, which a window's padding slots can reach) -> pool rows (B, N)."""
        bs = self.block_size
        blocks = self.flat.index_select(0, (self.base + floor_div(positions, bs)).view(-1)).view(positions.shape)
        return blocks * bs + floor_mod(positions, bs)


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
