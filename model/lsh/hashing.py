"""LSH hashing: the random rotations, the bucket count, and each position's bucket (argmax over [x, -x] of its
rotated query-key, factor by factor for a factorised count), as the reference (transformers' Reformer)
computes them. The PyTorch reference of every path: the forward, the ONNX graph, the sliced prefill and the
decode step hash through `LSHSelfAttention.hash`, which calls these; the C kernels `lsh_buckets` and `lsh_hash`
(model/kernels/csrc/step_linear.c) are tested against them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

NumBuckets = int | list[int]


def bucket_factors(num_buckets: NumBuckets) -> list[int]:
    """The factors of a bucket count: [n] for a plain count, the list for a factorised one."""
    return [num_buckets] if isinstance(num_buckets, int) else [int(f) for f in num_buckets]


def rotation_size(num_buckets: NumBuckets) -> int:
    """Rotated values per round: half of each factor, twice (x and -x), summed over the factors."""
    return sum(bucket_factors(num_buckets))


def padding_bucket(num_buckets: NumBuckets) -> int:
    """The bucket padding goes to: one past the real ones (their count, the factors' product)."""
    return math.prod(bucket_factors(num_buckets))


def hash_rotations(seed: int, heads: int, head_size: int, rounds: int, size: int) -> Tensor:
    """The random rotations (H, D, R, size/2) the reference draws after `torch.manual_seed(hash_seed)`, drawn
    here from a private CPU generator: same numbers, no global RNG side effect, independent of the device."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn((heads, head_size, rounds, size // 2), generator=g, dtype=torch.float32)


def auto_num_buckets(length: int, chunk: int, max_positions: int) -> NumBuckets:
    """The reference's choice when num_buckets is unset: 2*length/chunk rounded down to a power of two,
    factorised in two when it grows past 2*max(sqrt(max_positions/chunk), chunk). At least 2: a row no
    longer than a chunk attends densely and never hashes, and the formula would give it the fraction 1/2 (a
    batch mixing such a row with longer ones, or a cache built for so few tokens, then failed)."""
    power = max((2 * (length // chunk)).bit_length() - 1, 1)
    buckets = 2**power
    limit = 2 * max(int((max_positions // chunk) ** 0.5), chunk)
    if buckets > limit:
        return [2 ** (power // 2), 2 ** (power - power // 2)]
    return buckets


def rotate(x: Tensor, rotations: Tensor) -> Tensor:
    """x (B, H, L, D) float32, rotations (H, D, R, K) -> rotated (B, H, L, R, K)."""
    hh, dd, rr, kk = rotations.shape
    if x.shape[2] == 1 and x.shape[0] > 1:
        # a decode step's one position per row: per head, all rows' products in one (B, D) x (D, R*K) matmul;
        # broadcasting the rotations over B copies them B times (96 against 16 us at 32 rows, timed by hand)
        rotated = torch.bmm(x.view(x.shape[0], hh, dd).transpose(0, 1), rotations.reshape(hh, dd, rr * kk))
        rotated = rotated.transpose(0, 1).unsqueeze(2)  # (B, H, 1, R*K)
    else:
        rotated = torch.matmul(x, rotations.reshape(hh, dd, rr * kk))  # (B, H, L, R*K)
    return rotated.view(*x.shape[:3], rr, kk)  # (B, H, L, R, K)


def bucket_ids(rotated: Tensor, factors: list[int], kernel: Any = None) -> Tensor:
    """rotated (..., K) with K = sum(factors)/2 -> bucket (...) int64: per factor f, the argmax over [x, -x] of
    its f/2 values (x before -x on ties, the first index first), the factors' digits combined with the first
    factor least significant. `kernel`: the C kernels (model/kernels/), which make the same choice in one pass
    over a (B, H, L, R, K) float32 CPU tensor."""
    if kernel is not None:
        return kernel.lsh_buckets(rotated, factors)  # type: ignore[no-any-return]
    buckets: Tensor | None = None
    start, scale = 0, 1
    for f in factors:
        part = rotated[..., start : start + f // 2]
        # argmax over [x, -x] without building it: the larger of max(x) and -min(x) wins, x on ties
        hi, hi_idx = part.max(dim=-1)
        lo, lo_idx = part.min(dim=-1)
        digit = torch.where(hi >= -lo, hi_idx, lo_idx + f // 2)
        buckets = digit if buckets is None else buckets + scale * digit
        start, scale = start + f // 2, scale * f
    assert buckets is not None
    return buckets


def hash_buckets(x: Tensor, rotations: Tensor, num_buckets: NumBuckets, valid: Tensor | None,
                 kernel: Any = None) -> Tensor:
    """x (B, H, L, D) float32 and its rotations (H, D, R, rotation_size/2) -> buckets (B, H, R, L); padding
    (valid (B, L) False) gets the extra bucket `padding_bucket(num_buckets)`."""
    factors = bucket_factors(num_buckets)
    chosen = bucket_ids(rotate(x, rotations), factors, kernel).transpose(2, 3)  # (B, H, R, L)
    if valid is None:
        return chosen
    return chosen.masked_fill(~valid[:, None, None, :], padding_bucket(factors))
