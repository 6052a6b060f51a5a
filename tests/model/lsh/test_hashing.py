"""model/lsh/hashing.py: the bucket choice against its definition (argmax over [x, -x] per factor), the C
kernel's choice against the reference, and the rotations against the reference's global-seed draw."""

from __future__ import annotations

import pytest
import torch

from model.kernels import kernels
from model.lsh.hashing import (
    bucket_factors,
    bucket_ids,
    hash_buckets,
    hash_rotations,
    padding_bucket,
    rotate,
    rotation_size,
)


def _by_definition(rotated: torch.Tensor, factors: list[int]) -> torch.Tensor:
    """transformers' formula: per factor, argmax of cat([x, -x]); digits combined, first factor lowest."""
    out = torch.zeros(rotated.shape[:-1], dtype=torch.long)
    start, scale = 0, 1
    for f in factors:
        part = rotated[..., start : start + f // 2]
        out += scale * torch.argmax(torch.cat([part, -part], dim=-1), dim=-1)
        start, scale = start + f // 2, scale * f
    return out


@pytest.mark.parametrize("num_buckets", [2, 8, 64, [4, 8], [2, 16, 4]])
def test_bucket_ids_are_the_argmax_over_x_and_minus_x(num_buckets: int | list[int]) -> None:
    factors = bucket_factors(num_buckets)
    rotated = torch.randn(2, 3, 17, 2, rotation_size(num_buckets) // 2, generator=torch.Generator().manual_seed(1))
    want = _by_definition(rotated, factors)
    assert torch.equal(bucket_ids(rotated, factors), want)
    assert int(want.max()) < padding_bucket(num_buckets)
    native = kernels()
    if native is None:
        pytest.fail("the CPU kernels did not build (a C compiler is part of the test environment)")
    assert torch.equal(bucket_ids(rotated, factors, native), want)  # C lsh_buckets = the reference


def test_ties_go_to_x_and_the_first_index() -> None:
    rotated = torch.zeros(1, 1, 1, 1, 4)
    assert int(bucket_ids(rotated, [8])) == 0
    rotated[..., 2] = -1.0  # -x wins at index 2
    assert int(bucket_ids(rotated, [8])) == 4 + 2


def test_rotations_are_the_global_seed_draw() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        want = torch.randn((2, 16, 3, 12))
    assert torch.equal(hash_rotations(42, 2, 16, 3, 24), want)


def test_hash_buckets_puts_padding_in_the_extra_bucket() -> None:
    x = torch.randn(2, 2, 9, 16, generator=torch.Generator().manual_seed(2))
    rot = hash_rotations(0, 2, 16, 3, rotation_size([4, 8]))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    got = hash_buckets(x, rot, [4, 8], valid)  # (B, H, R, L)
    assert got.shape == (2, 2, 3, 9)
    assert (got[1, :, :, 6:] == 32).all()
    assert torch.equal(got[:, :, :, :6], _by_definition(rotate(x, rot), [4, 8]).transpose(2, 3)[:, :, :, :6])
    # a decode step's one position per row takes a batched product: the same buckets
    one = hash_buckets(x[:, :, 4:5], rot, [4, 8], None)
    assert torch.equal(one, got[:, :, :, 4:5])
