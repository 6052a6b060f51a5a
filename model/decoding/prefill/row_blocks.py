"""A prefill's whole-prompt products (embeddings, layer norms, projections, hashing, output projections) in
blocks of positions, for chunked prefill: the same bits as the one whole-prompt call.

Each of these computes every position alone (a row's embedding, its layer norm, its Linear outputs, its
rotations and their argmax), so cutting the position axis changes no value, provided each block's call
computes a row as the whole call does. For the Linears (MKL sgemm on the CPU) that held for blocks of at
least 16 rows: F.linear over 60,000 rows of 128 -> 128, 128 -> 512 and 512 -> 128 (and over 100 to 4,000
rows of 32 -> 32), on 1 and on 2 intra-op threads, equalled (`torch.equal`) its blocks of 16 to 8,192 rows
split evenly; blocks of 1 and 7 rows, and a last block of 3 or 11 rows, did not (MKL takes another path for
so few rows; a scratch check with torch 2.13, MKL 2024.2, AVX2). So the positions are split into nearly
equal blocks, none shorter than MIN_BLOCK_ROWS / 2 unless the whole call is; tests/model/decoding/
test_prefill_blocks.py checks, with `torch.equal` at blocks of 16-32 positions, a layer against the full
forward and a prefill against one in one block per product.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch
from torch import Tensor

# A whole-prompt product runs on at most this many rows (batch rows x positions) per piece. At 60,000
# positions of the shipped model each such product was one piece of 47-79 ms on a quiet 2-core machine
# (issue 34); on one thread at load average 6-7 (a scratch timing, CPU time of the thread) the embeddings
# took 47 ms, a 128 -> 128 projection 46-50 ms, the hash 60 ms (its rotations' matmul 33, the argmax 28).
# The last LSH layer's hash (piece 187 of 207), when the heap had no free block for its 61 MB of rotations,
# also faulted in 15,000 fresh pages: 124 ms against 89-91 ms in the runs that did not (one run of three,
# load average 5, bench/prefill/prefill_pieces.py); that was the 117-125 ms slice. In blocks of 8,192 rows (8 per
# product) every such piece took 6-17 ms at load average 5, with no page faults (bench/prefill/prefill_pieces.py).
# The shipped model's hashing then grew with its buckets (64 -> 1,024, 2 rounds): 8,192 rows of it rotate into
# 134 MB and slices of 108-128 ms took the streams' longest gap to 207-236 ms (five runs of
# bench/prefill/prefill_gap.py, bench/results/prefill_gap_shipped1024_*.json); blocks of 2,048 rows cut that piece by 4.
ROW_BLOCK = 2048
# Blocks of fewer rows than half this are never made (but for a call that is that short anyway): MKL's
# sgemm gave other bits for 1-11 rows (above)
MIN_BLOCK_ROWS = 32

Blocks = Generator[None, None, Tensor]


def position_blocks(batch: int, length: int, device: torch.device) -> list[tuple[int, int]]:
    """[a, b) ranges cutting `length` positions of `batch` rows into the fewest nearly equal blocks of at most
    ROW_BLOCK rows (batch x positions; at least MIN_BLOCK_ROWS // 2 positions each, unless `length` is less),
    in order. Off the CPU, one block: a GPU runs a 60K prompt's product in well under a millisecond, and
    cuBLAS chooses its kernels by the shape, so blocks there would buy no latency and could cost bits."""
    if device.type != "cpu":
        return [(0, length)]
    per = max(MIN_BLOCK_ROWS, ROW_BLOCK // max(batch, 1))
    count = max(1, -(-length // per))
    return [(i * length // count, (i + 1) * length // count) for i in range(count)]


def in_blocks(compute: Callable[[int, int], Tensor], batch: int, length: int, device: torch.device,
              dim: int = 1) -> Blocks:
    """compute(a, b), the result for positions a..b-1 (their axis `dim`), for every block of
    `position_blocks(batch, length, device)`, written into one tensor of all `length` positions; yields
    between blocks, not after the last (one block: no yield, the one call as before)."""
    blocks = position_blocks(batch, length, device)
    out: Tensor | None = None
    for i, (a, b) in enumerate(blocks):
        part = compute(a, b)
        if len(blocks) == 1:
            return part
        if out is None:
            shape = list(part.shape)
            shape[dim] = length
            out = torch.empty(shape, dtype=part.dtype, device=part.device)
        out.narrow(dim, a, b - a).copy_(part)
        if i < len(blocks) - 1:
            yield
    assert out is not None
    return out


def rows_in_blocks(fn: Callable[[Tensor], Tensor], x: Tensor) -> Blocks:
    """fn(x) for x (B, L, ...) and an fn that computes each position alone (a Linear, a LayerNorm), over
    blocks of positions (`in_blocks`)."""
    return in_blocks(lambda a, z: fn(x[:, a:z]), x.shape[0], x.shape[1], x.device)
