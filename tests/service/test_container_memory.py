"""A container's memory limit, read from its cgroup: a decode cache the limit cannot hold is refused at
start-up (not OOM-killed later), and the default cache is sized within the limit. Fake cgroup trees stand in
for `docker run --memory`; bench/docker/image_check.py checks the same in a real container."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch
from pydantic import ValidationError

from service import memory
from service.api import server
from service.engine.runner import CPU_CACHE_FRACTION, default_cache_bytes
from service.settings import Settings

GIB = 1 << 30


def cgroup_v2(root: Path, limit: str, current: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{current}\n")
    return root


def cgroup_v1(root: Path, limit: int, usage: int = 0) -> Path:
    (root / "memory").mkdir(parents=True, exist_ok=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    return root


def test_the_limit_is_read_from_cgroup_v2_and_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path / "v2", str(2 * GIB), current=GIB // 2))
    assert memory.container_memory_limit() == 2 * GIB
    assert memory.container_memory_available() == 2 * GIB - GIB // 2
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path / "v2max", "max"))
    assert memory.container_memory_limit() is None and memory.container_memory_available() is None
    monkeypatch.setattr(memory, "CGROUP", cgroup_v1(tmp_path / "v1", 3 * GIB, usage=GIB))
    assert memory.container_memory_limit() == 3 * GIB and memory.container_memory_available() == 2 * GIB
    # v1 without a limit: the largest page-aligned 64-bit value, as on a host or `docker run` without --memory
    monkeypatch.setattr(memory, "CGROUP", cgroup_v1(tmp_path / "v1none", 9223372036854771712))
    assert memory.container_memory_limit() is None
    monkeypatch.setattr(memory, "CGROUP", tmp_path / "none")
    assert memory.container_memory_limit() is None


def test_a_cache_the_limit_cannot_hold_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path, str(GIB)))
    with pytest.raises(ValidationError, match=r"cache_bytes \(2147483648 bytes\) does not fit the container's "
                       r"memory limit \(1073741824 bytes"):
        Settings(cache_bytes=2 * GIB)
    with pytest.raises(ValidationError, match="memory limit"):
        Settings(cache_bytes=GIB)
    assert Settings(cache_bytes=GIB // 4).cache_bytes == GIB // 4
    assert Settings().cache_bytes is None  # the default is sized within the limit, below
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path / "nolimit", "max"))
    assert Settings(cache_bytes=64 * GIB).cache_bytes == 64 * GIB


def test_reformer_serve_refuses_it_at_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path, str(GIB)))
    monkeypatch.setenv("REFORMER_CACHE_BYTES", str(4 * GIB))
    assert server.main([]) == 2  # before any model is loaded
    err = capsys.readouterr().err
    assert "invalid settings" in err and "does not fit the container's memory limit (1073741824 bytes" in err


def test_the_default_cache_is_sized_within_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    limit, used = 512 << 20, 128 << 20
    assert psutil.virtual_memory().available > limit  # else this test proves nothing on this machine
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path, str(limit), current=used))
    assert default_cache_bytes(cpu) == int((limit - used) * CPU_CACHE_FRACTION)
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path / "nolimit", "max"))
    assert default_cache_bytes(cpu) > limit * CPU_CACHE_FRACTION
