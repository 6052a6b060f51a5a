"""model/decoding/runtime.py: the process-wide settings `reformer train` and `reformer serve` apply at start-up."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model.decoding.runtime import container_cpus, fit_threads_to_container, tune_cpu_runtime


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


@pytest.mark.parametrize(("files", "want"), [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: two threads can make progress
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_container_cpus_reads_the_quota(tmp_path: Path, files: dict[str, str], want: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert container_cpus(tmp_path) == want


def test_threads_are_fitted_to_the_quota_unless_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert fit_threads_to_container(tmp_path) is None and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert fit_threads_to_container(tmp_path) == 1 and torch.get_num_threads() == 1
        assert fit_threads_to_container(tmp_path / "missing") is None
    finally:
        torch.set_num_threads(before)
