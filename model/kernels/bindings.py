"""The C kernels through ctypes (csrc/: window_attend.c, lsh_attend.c, decode_cache.c, step_linear.c,
step_linear_q.c, step_layers.c, extend_layers.c, chunk_attend.c): a
decode step's cache writes, each LSH layer's insert into its recent order, its window positions and attention
(`lsh_attend`), local layers' attention (`attend`), the merge of an LSH index's recent order into its main
order, a step's linear layers (`linear`, over weights packed by `pack`) and LSH hashes (`lsh_hash`), a layer's
tail (`tail_raw`), a layer norm (`norm_raw`), a whole step's layers in one call (`layers_raw`), one request's
new tokens through every layer in one call (`extend_raw`) and a forward's chunked window attention
(`chunk_attend`).

Every method takes plain tensors and ints (an LSH index as `IndexArrays`) and checks what it hands the C side
(dtypes, contiguity, shapes); the C side checks every index against the pools. The prototypes come from
abi.PROTOTYPES. Nothing here imports the model. Loading (which build, which variant) is build.py's.

The key and value pools may hold float32, bfloat16 or float16 rows; queries, scores and outputs are float32.
float16 needs a build for a CPU with F16C (`CpuKernels.reads`).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import abi

# window_rows.h's element kinds of the key and value pools
KIND = {torch.float32: abi.KIND_FLOAT32, torch.float16: abi.KIND_FLOAT16, torch.bfloat16: abi.KIND_BFLOAT16}


class IndexArrays(NamedTuple):
    """An LSH index's tensors and layout as the C side reads them (model/decoding/lsh_index.py
    `LSHIndex.arrays`)."""

    main_counts: Tensor  # (slots, H, R, buckets) int32
    recent_counts: Tensor  # (slots, H, R, buckets) int16
    items: Tensor  # both orders in one buffer, int16 or int32
    recent: Tensor  # (slots, H, R, recent_size): the recent part of `items`
    order_rows: int  # pool rows of the main order
    recent_size: int
    shift: int  # what a position is stored as: position + shift
    recent_offset: int  # where the recent part starts in `items`

    @property
    def buckets(self) -> int:
        return int(self.main_counts.shape[-1])


def _require(what: str, *wants: tuple[Tensor, torch.dtype | tuple[torch.dtype, ...]]) -> None:
    """Each tensor a contiguous CPU tensor of its dtype(s): the C side reads raw pointers."""
    for x, dtype in wants:
        ok = x.dtype in dtype if isinstance(dtype, tuple) else x.dtype == dtype
        if not ok or not x.is_cpu or not x.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous {dtype} CPU tensor, got {x.dtype} {tuple(x.shape)} on "
                             f"{x.device}{'' if x.is_contiguous() else ', not contiguous'}")


def pool_stride(what: str, keys: Tensor, values: Tensor) -> int:
    """The elements from one row of the key and value pools to the next, (N, D) rows or (N, H, D) rows of
    (position, head): CPU views with contiguous rows, evenly spaced, the same spacing in both (the decode
    cache keeps a row's key and value side by side, so each is a view with a stride of 2 * D)."""
    for x in (keys, values):
        if x.dim() not in (2, 3) or not x.is_cpu or x.stride(-1) != 1 or x.dim() == 3 and (
                x.stride(0) != x.shape[1] * x.stride(1)):
            raise ValueError(f"{what}: a pool must be a CPU tensor of evenly spaced contiguous rows, got "
                             f"{tuple(x.shape)} with strides {x.stride()} on {x.device}")
    stride = keys.stride(-2)
    if values.stride() != keys.stride() or stride < keys.shape[-1]:
        raise ValueError(f"{what}: key and value pools with strides {keys.stride()} and {values.stride()} for rows of "
                         f"{keys.shape[-1]}")
    return int(stride)


def check_status(status: int, what: str) -> None:
    """Raise for a C function's non-zero status (the codes of abi.py)."""
    if status & abi.BAD_KIND:
        raise ValueError(f"{what}: this build of the kernel does not read pools of that dtype")
    if status & abi.BAD_INDEX:
        raise IndexError(f"{what}: a window reached outside the decode cache (a corrupt index or block table)")
    if status & abi.NO_MEMORY:
        raise MemoryError(f"{what}: could not allocate its buffers")


class CpuKernels:
    """The loaded library's functions, declared from abi.PROTOTYPES."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fns = abi.declare(ctypes.CDLL(str(path)))
        self._fn, self._lsh, self._chunk = fns["window_attend"], fns["lsh_attend"], fns["chunk_attend"]
        self._merge_blocks, self._write, self._append = fns["lsh_merge_blocks"], fns["decode_write"], fns["lsh_append"]
        self._hash, self._buckets, self._order = fns["lsh_hash"], fns["lsh_buckets"], fns["lsh_order"]
        self._pack = fns["step_linear_pack"]
        # the product, layer-tail, layer-norm and whole-step functions as ctypes exposes them: their arguments
        # are not checked here, so callers pass what `pack` made (model/decoding/steps/ check their packings)
        self.linear_raw, self.tail_raw = fns["step_linear"], fns["step_tail"]
        self.linear_w_raw = fns["step_linear_w"]  # weights packed as abi.WEIGHTS says (model/kernels/weights.py)
        self.layers_raw, self.norm_raw = fns["decode_layers"], fns["layer_norm_rows"]
        self.extend_raw = fns["extend_layers"]  # one request's new tokens in one call (extend_layers.c)
        self.layer_words = int(fns["step_layer_words"]())
        self.embedding_words = int(fns["step_embedding_words"]())
        if (self.layer_words, self.embedding_words) != (ctypes.sizeof(abi.StepLayer) // 8,
                                                        ctypes.sizeof(abi.StepEmbedding) // 8):
            raise OSError(f"{path}: StepLayer and StepEmbedding of {self.layer_words} and {self.embedding_words} "
                          f"words, abi.py's {ctypes.sizeof(abi.StepLayer) // 8} and "
                          f"{ctypes.sizeof(abi.StepEmbedding) // 8}: a build of other sources")
        kinds = fns["window_kinds"]
        # the pool dtypes this build reads and writes
        self.reads = frozenset(dtype for dtype, kind in KIND.items() if kinds() >> kind & 1)

    def _kind(self, what: str, keys: Tensor, values: Tensor) -> int:
        if keys.dtype != values.dtype or keys.dtype not in self.reads:
            raise ValueError(f"{what}: key and value pools of {keys.dtype} and {values.dtype}; this build reads "
                             f"{sorted(str(d) for d in self.reads)}")
        return KIND[keys.dtype]

    def attend(self, q: Tensor, keys: Tensor, norms: Tensor | None, values: Tensor, flat: Tensor, absent: Tensor,
               pos: Tensor | None, t: Tensor | None, dead: Tensor | None, self_mask: float, mask: float) -> Tensor:
        """q (B, H, D) float32; keys, values (N, D) pools of one dtype of `reads` (rows evenly spaced, as
        `pool_stride` checks); norms (N,) float32;
        flat (B, H, R, W) int64 indices into them; absent (B, H or 1, R, W) bool; pos (B, H, R, W) int64 and
        t (B,) int64, or None (no self mask); dead (B, R) bool rounds of weight 0, or None. Returns (B, H, D)
        float32."""
        b, h, r, w = flat.shape
        d = q.shape[-1]
        if q.shape != (b, h, d) or keys.shape[-1] != d or values.shape[-1] != d:
            raise ValueError(f"window kernel: q {tuple(q.shape)}, keys {tuple(keys.shape)}, flat {tuple(flat.shape)}")
        if absent.shape not in ((b, h, r, w), (b, 1, r, w)):
            raise ValueError(f"window kernel: absent {tuple(absent.shape)} for windows {tuple(flat.shape)}")
        kind = self._kind("window kernel", keys, values)
        stride = pool_stride("window kernel", keys, values)
        _require("window kernel", (q, torch.float32), *(() if norms is None else ((norms, torch.float32),)))
        flat = flat.contiguous()
        absent = absent.contiguous()
        head_stride = 0 if absent.shape[1] == 1 and h > 1 else r * w
        if pos is not None:
            pos = pos.contiguous()
            assert t is not None and pos.shape == flat.shape and t.shape == (b,)
            t = t.contiguous()
        if dead is not None:
            dead = dead.contiguous()
            assert dead.shape == (b, r)
        if norms is not None and norms.shape != keys.shape[:1] or values.shape != keys.shape:
            raise ValueError(f"window kernel: pools {tuple(keys.shape)} and {tuple(values.shape)}")
        out = torch.empty(b, h, d, dtype=torch.float32)
        status = self._fn(b, h, r, w, d, kind, q.data_ptr(), keys.data_ptr(), 0 if norms is None else norms.data_ptr(),
                          values.data_ptr(), keys.shape[0], stride, flat.data_ptr(), absent.data_ptr(),
                          absent.shape[1] * r * w, head_stride,
                          0 if pos is None else pos.data_ptr(), 0 if t is None else t.data_ptr(),
                          0 if dead is None else dead.data_ptr(), self_mask, mask, out.data_ptr(),
                          torch.get_num_threads())
        check_status(status, "window kernel")
        return out

    def lsh_attend(self, q: Tensor, keys: Tensor, norms: Tensor, values: Tensor, meta: Tensor, buckets: Tensor,
                   index: IndexArrays, block_table: Tensor, block_size: int, scratch_slot: int, chunk: int, before: int,
                   after: int, self_mask: float, mask: float, successor: int = 0,
                   order_table: Tensor | None = None) -> Tensor:
        """One LSH layer's decode attention: q (B, H, D) float32, the layer's key, factor (float32) and value pools, the
        step's row facts meta (B, META_COLUMNS) int64 (model/decoding/step.py), the new position's buckets
        (B, H, R) int64,
        the layer's index after the step's insert, the cache's block table and its order table (where each slot's
        main order lives, model/decoding/cache.py; None: the block table). Returns (B, H, D) float32;
        rows on `scratch_slot` (padding) get zeros. Heads 0..successor-1 (successor-value heads) never attend
        the row's own position and give exactly 0 where nothing else is there."""
        b, h, d = q.shape
        rounds = buckets.shape[-1]
        if rounds > abi.MAX_ROUNDS or buckets.shape != (b, h, rounds) or meta.shape != (b, abi.META_COLUMNS):
            raise ValueError(f"lsh kernel: q {tuple(q.shape)}, buckets {tuple(buckets.shape)}, "
                             f"meta {tuple(meta.shape)}")
        main, recent, items = index.main_counts, index.recent_counts, index.items
        kind = self._kind("lsh kernel", keys, values)
        stride = pool_stride("lsh kernel", keys, values)
        orders = block_table if order_table is None else order_table
        if orders.shape != block_table.shape:
            raise ValueError(f"lsh kernel: an order table {tuple(orders.shape)} beside a block table "
                             f"{tuple(block_table.shape)}")
        _require("lsh kernel", (q, torch.float32), (norms, torch.float32), (meta, torch.int64), (buckets, torch.int64),
                 (main, torch.int32), (recent, torch.int16), (block_table, torch.int64),
                 (orders, torch.int64),
                 (items, (torch.int16, torch.int32)))
        if keys.shape != values.shape or keys.shape[0] % h or norms.shape != keys.shape[:1]:
            raise ValueError(f"lsh kernel: pools {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(norms.shape)}")
        out = torch.empty(b, h, d, dtype=torch.float32)
        status = self._lsh(b, h, rounds, main.shape[-1], chunk, before, after, d, index.recent_size, kind, q.data_ptr(),
                           keys.data_ptr(), norms.data_ptr(), values.data_ptr(), keys.shape[0] // h, stride,
                           meta.data_ptr(),
                           buckets.data_ptr(), main.data_ptr(), recent.data_ptr(), items.data_ptr(), items.numel(),
                           items.element_size(), index.shift,
                           index.recent_offset, block_table.data_ptr(), orders.data_ptr(), block_table.shape[1],
                           block_size, scratch_slot,
                           self_mask,
                           mask, successor, out.data_ptr(), torch.get_num_threads())
        check_status(status, "lsh kernel")
        return out

    def chunk_attend(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None,
                     rule: str, mask: float) -> tuple[Tensor, Tensor]:
        """q (B, H, N, C, D), k and v (B, H, N, W, D) float32 with contiguous rows (other dimensions any
        strides: overlapping window views), q_pos (B, H, N, C), k_pos and k_valid (B, H, N, W) (int64 below
        2**31, bool; any strides) -> (out (B, H, N, C, D), lse (B, H, N, C)) float32: each query's softmax over
        the valid keys `rule` allows (CHUNK_RULES; chunk_attend.c), on PyTorch's intra-op thread count."""
        b, h, n, c, d = q.shape
        w = k.shape[3]
        f32, i64 = torch.float32, torch.int64
        for name, x, dtype, shape in (("q", q, f32, (b, h, n, c, d)), ("k", k, f32, (b, h, n, w, d)),
                                      ("v", v, f32, (b, h, n, w, d)), ("q_pos", q_pos, i64, (b, h, n, c)),
                                      ("k_pos", k_pos, i64, (b, h, n, w)),
                                      ("k_valid", k_valid, torch.bool, (b, h, n, w))):
            if x is None:
                continue
            if x.dtype != dtype or not x.is_cpu or tuple(x.shape) != shape or (x.dim() == 5 and x.stride(-1) != 1):
                raise ValueError(f"chunk_attend: {name} must be a {dtype} CPU tensor of shape {shape} (rows "
                                 f"contiguous), got {x.dtype} {tuple(x.shape)} on {x.device}")
        out = torch.empty(b, h, n, c, d, dtype=torch.float32)
        lse = torch.empty(b, h, n, c, dtype=torch.float32)

        def strides(x: Tensor | None) -> Any:
            return None if x is None else (ctypes.c_int64 * 4)(*x.stride()[:4])

        status = self._chunk(b, h, n, c, w, d, q.data_ptr(), strides(q), k.data_ptr(), strides(k), v.data_ptr(),
                             strides(v), q_pos.data_ptr(), strides(q_pos), k_pos.data_ptr(), strides(k_pos),
                             None if k_valid is None else k_valid.data_ptr(), strides(k_valid), abi.CHUNK_RULES[rule],
                             mask,
                             out.data_ptr(), strides(out), lse.data_ptr(), strides(lse), torch.get_num_threads())
        check_status(status, "chunk attention kernel")
        return out, lse

    def write(self, rows: Tensor, key: Tensor, value: Tensor, keys: Tensor, values: Tensor, norms: Tensor | None,
              eps: float = abi.KEY_NORM_EPS, successor: int = 0, prev_rows: Tensor | None = None) -> None:
        """A step's new keys and values (B, H, D) float32 into pool rows `rows` (B,) of the pools (N, H, D),
        rounded to the pools' dtype as `Tensor.to` rounds, and for LSH layers each key's factor (from the
        float32 key) into `norms` (N, H) float32, as `DecodeCache.write_step` does: in heads 0..successor-1
        (successor-value heads) the value goes to rows `prev_rows` (B,) and the new rows' values are 0."""
        b, h, d = key.shape
        rows = rows.contiguous()
        if not 0 <= successor <= h:
            raise ValueError(f"write kernel: {successor} successor-value heads of {h}")
        if successor:
            if prev_rows is None or prev_rows.shape != (b,) or prev_rows.dtype != torch.int64 or not prev_rows.is_cpu:
                raise ValueError("write kernel: successor-value heads need prev_rows, (B,) int64 on the CPU")
            prev_rows = prev_rows.contiguous()
        kind = self._kind("write kernel", keys, values)
        stride = pool_stride("write kernel", keys, values)
        _require("write kernel", (rows, torch.int64),
                 *((x, torch.float32) for x in (key, value, *(() if norms is None else (norms,)))))
        if value.shape != key.shape or keys.shape[1:] != (h, d) or values.shape != keys.shape:
            raise ValueError(f"write kernel: key {tuple(key.shape)} into pools {tuple(keys.shape)}")
        if norms is not None and norms.shape != keys.shape[:2]:
            raise ValueError(f"write kernel: norms {tuple(norms.shape)} for pools {tuple(keys.shape)}")
        if rows.shape != (b,):
            raise ValueError(f"write kernel: rows {tuple(rows.shape)} for {b} keys")
        status = self._write(b, h, d, kind, keys.shape[0], stride, rows.data_ptr(), key.data_ptr(), value.data_ptr(),
                             keys.data_ptr(), values.data_ptr(), 0 if norms is None else norms.data_ptr(), eps,
                             math.sqrt(d), successor, 0 if prev_rows is None or not successor else prev_rows.data_ptr())
        check_status(status, "write kernel")

    def append(self, index: IndexArrays, meta: Tensor, buckets: Tensor) -> None:
        """`LSHIndex.append` for a step's rows that append (meta (B, META_COLUMNS) int64 as model/decoding/step.py
        builds it;
        buckets (B, H, R) int64), in place."""
        b, h, rounds = buckets.shape
        recent, items = index.recent_counts, index.items
        _require("append kernel", (buckets, torch.int64), (meta, torch.int64), (recent, torch.int16),
                 (items, (torch.int16, torch.int32)))
        if meta.shape != (b, abi.META_COLUMNS):
            raise ValueError(f"append kernel: meta {tuple(meta.shape)} for buckets {tuple(buckets.shape)}")
        status = self._append(b, h, rounds, index.buckets, index.recent_size, meta.data_ptr(), buckets.data_ptr(),
                              recent.data_ptr(), items.data_ptr(), items.element_size(), index.shift,
                              index.recent_offset)
        check_status(status, "append kernel")

    def pack(self, weight: Tensor) -> Tensor:
        """A linear layer's weight (N, K) float32 as `linear` reads it: ceil(N / 32) panels of (K, 32), columns
        past N zero (model/kernels/csrc/step_linear.c)."""
        _require("linear pack", (weight, torch.float32))
        n, k = weight.shape
        packed = torch.empty(-(-n // abi.PANEL) * k * abi.PANEL, dtype=torch.float32)
        self._pack(n, k, weight.data_ptr(), packed.data_ptr())
        return packed

    def linear(self, x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
        """x (M, K) float32 times the packed weight of a layer with N outputs, plus bias (N,): (M, N) float32,
        each element one chain of fused multiply-adds over k in order, whatever the other rows."""
        m, k = x.shape
        if packed.shape != (-(-n // abi.PANEL) * k * abi.PANEL,) or bias is not None and bias.shape != (n,):
            raise ValueError(f"linear kernel: x {tuple(x.shape)}, packed {tuple(packed.shape)} for {n} outputs, "
                             f"bias {None if bias is None else tuple(bias.shape)}")
        _require("linear kernel", (x, torch.float32), (packed, torch.float32),
                 *(() if bias is None else ((bias, torch.float32),)))
        out = torch.empty(m, n, dtype=torch.float32)
        self.linear_raw(m, n, k, x.data_ptr(), k, packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                     out.data_ptr())
        return out

    def lsh_hash(self, q: Tensor, packed: Tensor, rounds: int, factors: Sequence[int]) -> Tensor:
        """An LSH layer's buckets (B, H, R) int64 of a step's queries q (B, H, D) float32: `packed` (H, ...) is
        each head's rotations (D, R, rot/2) packed as a (R * rot/2, D) weight; `factors` the bucket count, or
        its factors (their halves summing to rot/2), as model/attention.py's `hash`."""
        b, h, d = q.shape
        half = sum(f // 2 for f in factors)
        if packed.shape != (h, -(-rounds * half // abi.PANEL) * d * abi.PANEL) or any(f < 2 or f % 2 for f in factors):
            raise ValueError(f"hash kernel: q {tuple(q.shape)}, packed {tuple(packed.shape)}, {rounds} rounds of "
                             f"factors {list(factors)}")
        _require("hash kernel", (q, torch.float32), (packed, torch.float32))
        fs = torch.tensor(list(factors), dtype=torch.int64)
        out = torch.empty(b, h, rounds, dtype=torch.int64)
        status = self._hash(b, h, rounds, d, half, len(factors), fs.data_ptr(), q.data_ptr(), packed.data_ptr(),
                            out.data_ptr())
        check_status(status, "hash kernel")
        return out

    def lsh_buckets(self, rotated: Tensor, factors: Sequence[int]) -> Tensor:
        """The buckets (..., R) int64 of rotated rows (..., R, rot/2) float32: per round, the argmax over [x, -x]
        of each factor's f/2 values, combined as model/attention.py's `hash` combines them (ties and NaNs
        included: the comparisons are the same)."""
        half = sum(f // 2 for f in factors)
        if rotated.shape[-1] != half or any(f < 2 or f % 2 for f in factors):
            raise ValueError(f"bucket kernel: rotated {tuple(rotated.shape)} for factors {list(factors)}")
        x = rotated.contiguous()
        _require("bucket kernel", (x, torch.float32))
        fs = torch.tensor(list(factors), dtype=torch.int64)
        out = torch.empty(x.shape[:-1], dtype=torch.int64)
        self._buckets(x.numel() // half // x.shape[-2], x.shape[-2], half, len(factors), fs.data_ptr(), x.data_ptr(),
                      out.data_ptr())
        return out

    def lsh_order(self, buckets: Tensor, count: int) -> Tensor:
        """Positions (..., L) int64 of every series of buckets (..., L) int64 sorted by (bucket, position): a
        counting sort, what `argsort(buckets * L + position)` gives; buckets must lie in [0, count)."""
        b = buckets.contiguous()
        _require("order kernel", (b, torch.int64))
        length = b.shape[-1]
        out = torch.empty_like(b)
        status = self._order(b.numel() // length, length, count, b.data_ptr(), out.data_ptr()) if b.numel() else 0
        if status & abi.BAD_INDEX:
            raise ValueError(f"order kernel: a bucket outside [0, {count})")
        check_status(status, "order kernel")
        return out

    def merge_blocks(self, index: IndexArrays, slot: int, table: Tensor, block_size: int, main_len: int,
                     recent_len: int) -> None:
        """`LSHIndex.merge_in_blocks`'s item moves in place, in one pass per (head, round) from the last bucket
        down, with the slot's pool rows read from its block table row `table` (blocks of `block_size`
        positions): no O(length) list of rows to build and check at every merge. The counts are left to the
        caller."""
        _, heads, rounds, _ = index.main_counts.shape
        items = index.items
        main, recent = index.main_counts[slot], index.recent_counts[slot]
        _require("merge kernel", (table, torch.int64), (main, torch.int32), (recent, torch.int16),
                 (items, (torch.int16, torch.int32)))
        if table.dim() != 1 or table.shape[0] * block_size < main_len + recent_len:
            raise ValueError(f"merge kernel: a block table row {tuple(table.shape)} of {block_size}-position blocks "
                             f"for {main_len} + {recent_len} positions")
        status = self._merge_blocks(heads * rounds, index.buckets, main_len, recent_len, index.recent_size,
                                    items.data_ptr(), items.element_size(), index.order_rows, table.data_ptr(),
                                    block_size, main.data_ptr(), recent.data_ptr(), index.recent[slot].data_ptr())
        check_status(status, "merge kernel")
