"""model/lsh/order.py: the bucket order against its definition, and the C counting sort against it."""

from __future__ import annotations

import pytest
import torch

from model.kernels import kernels
from model.lsh.order import bucket_order


def test_bucket_order_sorts_by_bucket_then_position() -> None:
    buckets = torch.randint(0, 5, (3, 40), generator=torch.Generator().manual_seed(3))
    got = bucket_order(buckets)
    for row, order in zip(buckets.tolist(), got.tolist()):
        assert order == sorted(range(40), key=lambda p: (row[p], p))


@pytest.mark.parametrize("shape, count", [((2, 3, 2, 50), 8), ((1, 1, 1, 1), 1), ((4, 300), 64)])
def test_the_c_counting_sort_is_the_reference(shape: tuple[int, ...], count: int) -> None:
    native = kernels()
    if native is None:
        pytest.fail("the CPU kernels did not build (a C compiler is part of the test environment)")
    buckets = torch.randint(0, count, shape, generator=torch.Generator().manual_seed(4))
    want = bucket_order(buckets)
    assert torch.equal(bucket_order(buckets, count, native), want)
    assert torch.equal(bucket_order(buckets, None, native), want)  # the count from the buckets
