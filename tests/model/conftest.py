"""Fixtures shared by the tests of the C step kernels (test_step_linear.py, test_step_fused.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from model.kernels import CpuKernels, kernels


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    k = kernels()
    if k is None:
        pytest.fail("the CPU kernels did not build (a C compiler is part of the test environment)")
    return k


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as a decode step of a few rows runs (model.decoding.step_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
