"""The decode cache's row lookups and its pools' reads and writes (model/decoding/cache.py's DecodeCache mixes
them in): where a (slot, position) lives in the block pools or a local layer's ring, where a slot's main bucket
order lives, and a step's writes and gathers of keys, values and key factors."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..attention import KEY_NORM_EPS
from .cache_state import DecodeState
from .lsh_index import BlockLookup

if TYPE_CHECKING:
    from ..kernels import CpuKernels
    from .local_ring import LocalRing
    from .lsh_index import LSHIndex


def key_norm(key: Tensor, eps: float = KEY_NORM_EPS) -> Tensor:
    """(..., D) -> (...) float32: what `length_normalize` multiplies a key by, divided by sqrt(D). The mean
    square is taken in float32: squaring a half-precision key overflows fp16 past ~256."""
    k = key.float()
    return torch.rsqrt(torch.mean(k * k, dim=-1) + eps) / math.sqrt(key.shape[-1])


class PoolRows:
    """What DecodeCache.__init__ sets and these read: the tables, the pools and their dtypes."""

    block_table: Tensor
    order_table: Tensor
    block_size: int
    device: torch.device
    ring: LocalRing
    indexes: list[LSHIndex | None]
    kv: list[Tensor]
    keys: list[Tensor]
    values: list[Tensor]
    norms: list[Tensor | None]
    kv_dtype: torch.dtype
    dtype: torch.dtype
    head_size: int
    kernel: CpuKernels | None

    def is_ring(self, layer: int) -> bool:
        """Whether `layer` keeps its keys and values in per-slot rings (a local layer), not in blocks."""
        return self.indexes[layer] is None

    def rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Row of each (slot, position) in the flattened block pools; positions (B, ...) with slots (B,)."""
        lookup = BlockLookup(self.block_table, slots, self.block_size)
        return lookup.rows(positions.reshape(slots.shape[0], -1)).view(positions.shape)

    def layer_rows(self, layer: int, slots: Tensor, positions: Tensor) -> Tensor:
        """`rows` in `layer`'s pools: its ring rows for a local layer (only its window's positions are there)."""
        return self.ring.rows(slots, positions) if self.is_ring(layer) else self.rows(slots, positions)

    def held_rows(self, layer: int, state: DecodeState) -> Tensor:
        """Pool rows (n,) of the positions `layer` holds for a request, in position order: every position in
        the blocks, the last window's (`LocalRing.kept`) in a local layer's ring."""
        kept = self.ring.kept(state.length) if self.is_ring(layer) else range(state.length)
        positions = torch.arange(kept.start, kept.stop, device=self.device).view(1, -1)
        return self.layer_rows(layer, torch.tensor([state.slot], device=self.device), positions).view(-1)

    def slot_rows(self, state: DecodeState, start: int, stop: int) -> Tensor:
        """Pool rows (stop - start,) of a request's positions start..stop-1 in the block pools."""
        slot = torch.tensor([state.slot], device=self.device)
        return self.rows(slot, torch.arange(start, stop, device=self.device).view(1, -1)).view(-1)

    def order_rows(self, state: DecodeState, start: int, stop: int) -> Tensor:
        """Rows (stop - start,) of each LSH index's `order` that hold a request's main-order sorted indices
        start..stop-1 (through its order table row)."""
        slot = torch.tensor([state.slot], device=self.device)
        lookup = BlockLookup(self.order_table, slot, self.block_size)
        return lookup.rows(torch.arange(start, stop, device=self.device).view(1, -1)).view(-1)

    def write(self, layer: int, rows: Tensor, key: Tensor, value: Tensor) -> None:
        """rows (B,), key/value (B, H, D)."""
        self.keys[layer].index_copy_(0, rows, key.to(self.kv_dtype))
        self.values[layer].index_copy_(0, rows, value.to(self.kv_dtype))
        norms = self.norms[layer]
        if norms is not None:
            norms.index_copy_(0, rows, key_norm(key).to(self.dtype))

    def write_step(self, layer: int, rows: Tensor, key: Tensor, value: Tensor, successor: int = 0,
                   prev_rows: Tensor | None = None) -> None:
        """A decode step's `write`: through the C kernel when the cache has it (one call instead of six
        index copies and the key factor's five ops). Heads 0..successor-1 are successor-value heads
        (model/lsh/successor.py): a position's value slot holds the value of the position after it, so the
        new value goes to `prev_rows` (B,), the rows of the positions before the new ones, and the new
        positions' slots hold 0 until the next step writes them."""
        if successor and prev_rows is None:
            raise ValueError("a step's write with successor-value heads needs the previous positions' rows")
        if self.kernel is None:
            if successor:
                ahead = value[:, :successor]  # (B, k, D): the previous positions' values in those heads
                value = torch.cat([torch.zeros_like(ahead), value[:, successor:]], dim=1)  # (B, H, D)
            self.write(layer, rows, key, value)
            if successor:
                self.values[layer][prev_rows, :successor] = ahead.to(self.kv_dtype)
            return
        self.kernel.write(rows, key.contiguous(), value.contiguous(), self.keys[layer], self.values[layer],
                          self.norms[layer], successor=successor, prev_rows=prev_rows)

    def gather_keys(self, layer: int, flat: Tensor) -> tuple[Tensor, Tensor | None]:
        """flat (row * heads + head) indices (...) -> keys (..., D) and, for LSH layers, the key factors (...)."""
        d = self.head_size
        # index_select on the flat index is the cheapest row gather on CPU (timed once by hand, torch 2.13,
        # 2048 rows of 64: ~90 us against ~113 us for an embedding lookup and ~400 us for pool[flat])
        at = flat.reshape(-1)
        keys = self.keys[layer].view(-1, d).index_select(0, at).view(*flat.shape, d)
        norms = self.norms[layer]
        return keys, None if norms is None else norms.view(-1).index_select(0, at).view(flat.shape)

    def weighted_values(self, layer: int, flat: Tensor, weights: Tensor) -> Tensor:
        """sum over the last dim of weights (..., N) (float32) times the values at flat indices (..., N):
        (..., D) float32. A float32 pool runs it as one `embedding_bag` (a bag per leading index), which
        never materialises the gathered values (timed by hand, 16,384 rows of 64, one thread: 70 us against
        160 us for the gather alone); other dtypes gather and multiply in float32."""
        d, n = self.head_size, flat.shape[-1]
        if self.kv_dtype == torch.float32:
            # over the contiguous (key, value) rows, where flat index f's value is row 2f + 1 (embedding_bag
            # copies a strided weight whole first: 68 ms for a 100K-position pool, timed by hand)
            out = torch.nn.functional.embedding_bag(flat.reshape(-1, n) * 2 + 1, self.kv[layer].view(-1, d),
                                                    mode="sum", per_sample_weights=weights.reshape(-1, n))
            return out.view(*flat.shape[:-1], d)
        pool = self.values[layer].view(-1, d)
        values = pool.index_select(0, flat.reshape(-1)).view(*flat.shape, d).float()
        return torch.matmul(weights.unsqueeze(-2), values).squeeze(-2)
