"""model/cpu_runtime.py: the process-wide settings `reformer train` and `reformer serve` apply at start-up."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest
import torch

from model.cpu_runtime import tune_cpu_runtime


@pytest.fixture
def restore_denormals() -> Iterator[None]:
    yield
    torch.set_flush_denormal(False)  # the rest of this test process keeps torch's default


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="flush-to-zero is an x86 (SSE3) mode")
def test_denormals_flush_to_zero_after_tuning(restore_denormals: None) -> None:
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # below float32's smallest normal number, 1.2e-38
    assert (tiny * 1.0).item() != 0.0
    done = tune_cpu_runtime()
    assert done["flush_denormal"]
    assert (tiny * 1.0).item() == 0.0


def test_malloc_thresholds_are_set_on_glibc(restore_denormals: None) -> None:
    done = tune_cpu_runtime()
    assert done["malloc_thresholds"] == (platform.libc_ver()[0] == "glibc")
