"""The C kernels of cached decoding on the CPU (model/kernels/window_attend.c, step_linear.c and step_layers.c)
and of a forward's chunked window attention (chunk_attend.c, `chunk_attend`, called by model/lsh_fused.py),
built on first use with the machine's C compiler and called through ctypes: a step's cache writes, each LSH
layer's insert into its recent order, its window positions and attention (`lsh_attend`), local layers'
attention (`attend`), the merge of an LSH index's recent order into its main order, a step's linear layers
(`linear`, over weights packed by `pack`) and LSH hashes (`lsh_hash`), a layer's tail (its output projection
and feed-forward, `tail_raw`, called by model/step_linear.py), a layer norm (`norm_raw`), and a whole step's
layers in one call (`layers_raw`, called by model/step_fused.py).

The attention computes what the PyTorch path of `model/decode.py` computes for a step's windows (the key
gather, the dot products and the masks, each round's log-sum-exp, the rounds' weights and the weighted
sum of values) in one pass per (row, head) that prefetches the pool rows it is about to read. The library
is compiled with `-O3 -march=native` into a cache folder, under a name made from a hash of the sources, the
flags, the compiler and the CPU's feature flags, so a copy built for another CPU is never loaded; a new build
deletes all but the KEEP_BUILDS newest there. Without a compiler (or with REFORMER_CPU_KERNELS=0) `load()`
returns None and decoding keeps the PyTorch path; the reason is logged once.

The key and value pools may hold float32, bfloat16 or float16 rows (a decode cache's `kv_dtype`); queries,
scores and outputs are float32. float16 needs a build for a CPU with F16C (`WindowKernel.reads`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .decode_index import LSHIndex

log = logging.getLogger(__name__)

# compiled together into one library: the attention windows, a step's linear layers (model/step_linear.py),
# the whole step's layers in one call (model/step_fused.py) and a forward's chunked window attention
# (model/lsh_fused.py)
SOURCES = tuple(Path(__file__).with_name("kernels") / name
                for name in ("window_attend.c", "step_linear.c", "step_layers.c", "chunk_attend.c"))
HEADERS = (Path(__file__).with_name("kernels") / "step_kernels.h",)  # what the sources include
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")
# step_layers.c splits a step between OpenMP threads (the OpenMP runtime PyTorch has loaded: one pool of
# threads for both); a compiler without OpenMP builds it single-threaded
OPENMP = "-fopenmp"
ENV_SWITCH = "REFORMER_CPU_KERNELS"  # "0" turns the kernel off (the service's setting of the same name sets it)
MAX_ROUNDS = 64  # the C side's bound on hash rounds
PANEL = 32  # step_linear.c's columns per packed panel
# window_attend.c's element kinds of the key and value pools
KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# chunk_attend.c's rules for which keys a query may see: LSH attention (its own position only when nothing
# else is allowed: the caller rebuilds those rows), causal or not; local attention, causal or not
CHUNK_RULES = {"other": 0, "earlier": 1, "up_to": 2, "any": 3}
ENV_DIR = "REFORMER_KERNEL_DIR"  # where built libraries are kept (default: the user's cache folder)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reformer-serve" / "kernels"


# built libraries kept in the cache folder: each edit of the source, compiler or CPU makes a new one
KEEP_BUILDS = 4


def _prune(folder: Path, keep: Path) -> None:
    """Delete all but the KEEP_BUILDS newest libraries in `folder` (never `keep`, the one just built). A
    process that has a deleted one loaded keeps its mapping; one that looks for it later builds it again."""
    builds = sorted(folder.glob("window_attend-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in builds if p != keep][KEEP_BUILDS - 1:]:
        try:
            old.unlink()
        except OSError:  # another process pruned it first, or the folder is read-only: harmless
            pass


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent process never loads a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for flags in ((*FLAGS, OPENMP), FLAGS):  # without OpenMP only when the compiler refuses it
            try:
                subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if flags == FLAGS:
                    raise
                log.warning("the C kernels build without OpenMP: a step's layers run on one thread")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _prune(target.parent, target)


_NO_MEMORY, _BAD_INDEX, _BAD_KIND = 1, 2, 4  # the kernels' statuses (kernels/step_kernels.h)


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
    """Raise for a C function's non-zero status (the codes of kernels/step_kernels.h)."""
    if status & _BAD_KIND:
        raise ValueError(f"{what}: this build of the kernel does not read pools of that dtype")
    if status & _BAD_INDEX:
        raise IndexError(f"{what}: a window reached outside the decode cache (a corrupt index or block table)")
    if status & _NO_MEMORY:
        raise MemoryError(f"{what}: could not allocate its buffers")


class WindowKernel:
    """The loaded library's functions, with their argument types declared once. Each method checks what it
    hands the C side (dtypes, contiguity, shapes); the C side checks every index against the pools."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

        def declare(name: str, argtypes: Sequence[type]) -> Any:  # a C function returning its int status
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            return fn

        self._fn = declare("window_attend", [i64] * 6 + [ptr] * 4 + [i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, f32,
                                                                   f32, ptr, i64])
        self._lsh = declare("lsh_attend", [i64] * 10 + [ptr] * 4 + [i64, i64] + [ptr] * 5 + [i64] * 4
                            + [ptr, i64, i64, i64, f32, f32, ptr, i64])
        self._chunk = declare("chunk_attend", [i64] * 6 + [ptr] * 12 + [i64, f32] + [ptr] * 4 + [i64])
        self._merge = declare("lsh_merge", [i64] * 5 + [ptr, i64, i64] + [ptr] * 4)
        self._write = declare("decode_write", [i64] * 6 + [ptr] * 6 + [f32, f32])
        self._append = declare("lsh_append", [i64] * 5 + [ptr] * 4 + [i64] * 3)
        # the product and layer-tail functions as ctypes exposes them: their arguments are not checked, so
        # callers pass what `pack` made (model/step_linear.py checks its packings when it makes them)
        self.linear_raw = declare("step_linear", [i64] * 3 + [ptr, i64] + [ptr] * 3)
        self._hash = declare("lsh_hash", [i64] * 6 + [ptr] * 4)
        self._buckets = lib.lsh_buckets  # no status: it reads and writes only what it is given
        self._buckets.argtypes, self._buckets.restype = [i64] * 4 + [ptr] * 3, None
        self._order = declare("lsh_order", [i64] * 3 + [ptr] * 2)
        self.tail_raw = declare("step_tail", [i64] * 4 + [ptr] * 7 + [f32] + [ptr] * 2 + [i64] + [ptr] * 2)
        # a whole step's layers (model/step_fused.py builds the layer array; unchecked here, as the two above)
        self.layers_raw = declare("decode_layers", [i64] * 3 + [ptr] * 2 + [i64, ptr, ptr] + [ptr] * 6 + [i64] * 4
                                  + [ptr] * 2 + [f32] + [ptr] * 2 + [i64, ptr, i64])
        self.norm_raw = lib.layer_norm_rows  # (m, n, x, weight, bias, eps, y): rows of x layer-normed into y
        self.norm_raw.argtypes, self.norm_raw.restype = [i64, i64, ptr, ptr, ptr, f32, ptr], None
        words = lib.step_layer_words
        words.argtypes, words.restype = [], ctypes.c_int64
        self.layer_words = int(words())
        embedding_words = lib.step_embedding_words
        embedding_words.argtypes, embedding_words.restype = [], ctypes.c_int64
        self.embedding_words = int(embedding_words())
        self._pack = lib.step_linear_pack
        self._pack.argtypes, self._pack.restype = [i64, i64, ptr, ptr], None
        kinds = lib.window_kinds
        kinds.argtypes, kinds.restype = [], ctypes.c_int64
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
                   index: LSHIndex, block_table: Tensor, block_size: int, scratch_slot: int, chunk: int, before: int,
                   after: int, self_mask: float, mask: float) -> Tensor:
        """One LSH layer's decode attention: q (B, H, D) float32, the layer's key, factor (float32) and value pools, the
        step's row facts meta (B, 7) int64 (model/decode.py), the new position's buckets (B, H, R) int64,
        the layer's index after the step's insert and the cache's block table. Returns (B, H, D) float32;
        rows on `scratch_slot` (padding) get zeros."""
        b, h, d = q.shape
        rounds = buckets.shape[-1]
        if rounds > MAX_ROUNDS or buckets.shape != (b, h, rounds) or meta.shape != (b, 7):
            raise ValueError(f"lsh kernel: q {tuple(q.shape)}, buckets {tuple(buckets.shape)}, "
                             f"meta {tuple(meta.shape)}")
        main, recent, items = index.main_counts, index.recent_counts, index.items
        kind = self._kind("lsh kernel", keys, values)
        stride = pool_stride("lsh kernel", keys, values)
        _require("lsh kernel", (q, torch.float32), (norms, torch.float32), (meta, torch.int64), (buckets, torch.int64),
                 (main, torch.int32), (recent, torch.int16), (block_table, torch.int64),
                 (items, (torch.int16, torch.int32)))
        if keys.shape != values.shape or keys.shape[0] % h or norms.shape != keys.shape[:1]:
            raise ValueError(f"lsh kernel: pools {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(norms.shape)}")
        out = torch.empty(b, h, d, dtype=torch.float32)
        status = self._lsh(b, h, rounds, main.shape[-1], chunk, before, after, d, index.recent_size, kind, q.data_ptr(),
                           keys.data_ptr(), norms.data_ptr(), values.data_ptr(), keys.shape[0] // h, stride,
                           meta.data_ptr(),
                           buckets.data_ptr(), main.data_ptr(), recent.data_ptr(), items.data_ptr(), items.numel(),
                           items.element_size(), index.shift,
                           index.recent_offset, block_table.data_ptr(), block_table.shape[1], block_size, scratch_slot,
                           self_mask,
                           mask, out.data_ptr(), torch.get_num_threads())
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
                             None if k_valid is None else k_valid.data_ptr(), strides(k_valid), CHUNK_RULES[rule], mask,
                             out.data_ptr(), strides(out), lse.data_ptr(), strides(lse), torch.get_num_threads())
        check_status(status, "chunk attention kernel")
        return out, lse

    def write(self, rows: Tensor, key: Tensor, value: Tensor, keys: Tensor, values: Tensor, norms: Tensor | None,
              eps: float = 1e-6) -> None:
        """A step's new keys and values (B, H, D) float32 into pool rows `rows` (B,) of the pools (N, H, D),
        rounded to the pools' dtype as `Tensor.to` rounds, and for LSH layers each key's factor (from the
        float32 key) into `norms` (N, H) float32, as `DecodeCache.write` does."""
        b, h, d = key.shape
        rows = rows.contiguous()
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
                             math.sqrt(d))
        check_status(status, "write kernel")

    def append(self, index: LSHIndex, meta: Tensor, buckets: Tensor) -> None:
        """`LSHIndex.append` for a step's rows that append (meta (B, 7) int64 as model/decode.py builds it;
        buckets (B, H, R) int64), in place."""
        b, h, rounds = buckets.shape
        recent, items = index.recent_counts, index.items
        _require("append kernel", (buckets, torch.int64), (meta, torch.int64), (recent, torch.int16),
                 (items, (torch.int16, torch.int32)))
        if meta.shape != (b, 7):
            raise ValueError(f"append kernel: meta {tuple(meta.shape)} for buckets {tuple(buckets.shape)}")
        status = self._append(b, h, rounds, index.buckets, index.recent_size, meta.data_ptr(), buckets.data_ptr(),
                              recent.data_ptr(), items.data_ptr(), items.element_size(), index.shift,
                              index.recent_offset)
        check_status(status, "append kernel")

    def pack(self, weight: Tensor) -> Tensor:
        """A linear layer's weight (N, K) float32 as `linear` reads it: ceil(N / 32) panels of (K, 32), columns
        past N zero (model/kernels/step_linear.c)."""
        _require("linear pack", (weight, torch.float32))
        n, k = weight.shape
        packed = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
        self._pack(n, k, weight.data_ptr(), packed.data_ptr())
        return packed

    def linear(self, x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
        """x (M, K) float32 times the packed weight of a layer with N outputs, plus bias (N,): (M, N) float32,
        each element one chain of fused multiply-adds over k in order, whatever the other rows."""
        m, k = x.shape
        if packed.shape != (-(-n // PANEL) * k * PANEL,) or bias is not None and bias.shape != (n,):
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
        if packed.shape != (h, -(-rounds * half // PANEL) * d * PANEL) or any(f < 2 or f % 2 for f in factors):
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
        if status & _BAD_INDEX:
            raise ValueError(f"order kernel: a bucket outside [0, {count})")
        check_status(status, "order kernel")
        return out

    def merge(self, index: LSHIndex, slot: int, rows: Tensor, main_len: int, recent_len: int) -> None:
        """`LSHIndex.merge`'s item moves in place, in one pass per (head, round) from the last bucket down;
        the counts are left to the caller."""
        _, heads, rounds = index.shape
        items = index.items
        main, recent = index.main_counts[slot], index.recent_counts[slot]
        rows = rows.contiguous()
        _require("merge kernel", (rows, torch.int64), (main, torch.int32), (recent, torch.int16),
                 (items, (torch.int16, torch.int32)))
        if rows.shape != (main_len + recent_len,):
            raise ValueError(f"merge kernel: rows {tuple(rows.shape)} for {main_len} + {recent_len}")
        status = self._merge(heads * rounds, index.buckets, main_len, recent_len, index.recent_size, items.data_ptr(),
                             items.element_size(), index.order.shape[0], rows.data_ptr(), main.data_ptr(),
                             recent.data_ptr(), index.recent[slot].data_ptr())
        check_status(status, "merge kernel")


@functools.lru_cache(maxsize=1)
def load() -> WindowKernel | None:
    """The kernel, built if needed; None when REFORMER_CPU_KERNELS=0, when no C compiler is found, or when
    the build fails (logged once; decoding then runs its PyTorch path)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("cpu window kernel off (%s=0): decoding uses PyTorch ops", ENV_SWITCH)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decoding on the CPU uses PyTorch ops for its attention windows")
        return None
    try:
        digest = hashlib.sha256()
        for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), " ".join((*FLAGS, OPENMP)).encode(),
                     compiler.encode(), platform.machine().encode(), _cpu_flags().encode()):
            digest.update(part)
        target = _cache_dir() / f"window_attend-{digest.hexdigest()[:16]}.so"
        if not target.exists():
            _build(compiler, target)
        return WindowKernel(target)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("cpu window kernel unavailable (%s): decoding uses PyTorch ops", detail)
        return None
