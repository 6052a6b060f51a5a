"""Chunking with look-back: which chunks each chunk of a (bucket-sorted, or as-is) sequence attends to, and the
windows of keys that makes. The neighbours wrap around the concatenation of all hash rounds, as in the
reference. The reference computes that wrap on the padded batch, so a sequence's result would depend on how
much padding it was batched with; here every row wraps within its *own* padded length (`own_chunks`), which is
what the reference computes for that row alone. Local layers use the same windows with one round.

`window_chunk_index` with `gather_chunks` is the reference; `look_adjacent` (every row of the batch's length)
and `strided_windows` (the same windows as overlapping views, no copy) are faster forms the forward uses where
they apply, tested equal to it (tests/model/lsh/test_windows.py)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def window_chunk_index(
    own_chunks: Tensor, rounds: int, chunks: int, before: int, after: int
) -> Tensor:
    """Index of the chunks each chunk attends to.

    own_chunks: (B,) chunks per round holding each row's own (padded) sequence, <= `chunks`.
    Returns (B, rounds*chunks, before+1+after) indices into the flattened (round, chunk) axis.
    """
    device = own_chunks.device
    n = own_chunks.view(-1, 1, 1)  # (B, 1, 1)
    r = torch.arange(rounds, device=device).view(1, rounds, 1, 1)
    j = torch.arange(chunks, device=device).view(1, 1, chunks, 1)
    off = torch.arange(-before, after + 1, device=device).view(1, 1, 1, -1)
    n4 = n.unsqueeze(-1)  # (B, 1, 1, 1)
    # position in the row's own layout of rounds*own_chunks chunks, wrapped circularly
    t = torch.remainder(r * n4 + j + off, rounds * n4)
    idx = (t // n4) * chunks + t % n4  # (B, rounds, chunks, W)
    # chunks past a row's own length hold only padding: let them look at themselves
    own = r * chunks + j
    idx = torch.where(j < n4, idx, own.expand_as(idx))
    return idx.reshape(own_chunks.shape[0], rounds * chunks, before + 1 + after)


def gather_chunks(x: Tensor, win: Tensor) -> Tensor:
    """x: (B, H, N, C, *rest); win: (B, N, W) -> (B, H, N, W*C, *rest)."""
    b, h, n, c = x.shape[:4]
    rest = x.shape[4:]
    w = win.shape[-1]
    flat = x.transpose(1, 2).reshape(b * n, h, c, *rest)  # (B*N, H, C, *rest)
    base = torch.arange(b, device=x.device).view(b, 1, 1) * n
    picked = flat[(win + base).reshape(-1)]  # (B*N*W, H, C, *rest)
    picked = picked.view(b, n, w, h, c, *rest).permute(0, 3, 1, 2, 4, *range(5, 5 + len(rest)))
    return picked.reshape(b, h, n, w * c, *rest)  # (B, H, N, W*C, *rest)


def look_adjacent(x: Tensor, before: int, after: int) -> Tensor:
    """Each chunk with its neighbours, circular over the chunk axis (every row has the batch's length).
    x (B, H, N, C, *rest) -> (B, H, N, (before+1+after)*C, *rest), previous chunks first."""
    b, h, n, c = x.shape[:4]
    rest = x.shape[4:]
    w = before + 1 + after
    out = x.new_empty(b, h, n, w, c, *rest)
    for slot, off in enumerate(range(-before, after + 1)):
        # slot `slot` of chunk j holds chunk (j + off) mod N
        s = off % n
        if s == 0:
            out[:, :, :, slot] = x
        else:
            out[:, :, : n - s, slot] = x[:, :, s:]
            out[:, :, n - s :, slot] = x[:, :, :s]
    return out.view(b, h, n, w * c, *rest)


def strided_windows(x: Tensor, chunk: int, before: int, after: int) -> Tensor:
    """Like `look_adjacent`, for a sequence whose chunks are contiguous: each window is a view into the
    sequence extended by the wrapped chunks, so no window is copied. (Read-only: windows overlap.)
    x (B, H, N*C, *rest) -> (B, H, N, (before+1+after)*C, *rest)."""
    parts = ([x[:, :, x.shape[2] - before * chunk:]] if before else []) + [x] + \
        ([x[:, :, : after * chunk]] if after else [])
    ext = torch.cat(parts, dim=2) if len(parts) > 1 else x.contiguous()
    n = x.shape[2] // chunk
    row = math.prod(x.shape[3:])
    size = (x.shape[0], x.shape[1], n, (before + 1 + after) * chunk, *x.shape[3:])
    stride = (ext.stride(0), ext.stride(1), chunk * row, *ext.stride()[2:])
    return ext.as_strided(size, stride)
