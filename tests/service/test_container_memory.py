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


def test_the_prefix_cache_counts_in_the_start_up_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix cache's memory tier and the disk writer's queue are host memory: with the decode cache they
    must fit the limit, and the refusal names the prefix cache's settings."""
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path, str(4 * GIB)))
    # each fits alone; together they do not
    with pytest.raises(ValidationError, match=r"the prefix cache's memory \(prefix_cache_bytes 3221225472 bytes "
                       r"\+ cache_bytes 2147483648 bytes: 5368709120 bytes\) does not fit the container's memory "
                       r"limit \(4294967296 bytes.*REFORMER_PREFIX_CACHE_BYTES"):
        Settings(cache_bytes=2 * GIB, prefix_cache_bytes=3 * GIB, device="cpu")
    # its default share of cache_bytes counts too: 3 GiB + 1.5 GiB
    with pytest.raises(ValidationError, match=r"prefix_cache_bytes 1610612736 bytes \(its default: 0.5 of "
                       "cache_bytes\\)"):
        Settings(cache_bytes=3 * GIB, device="cpu")
    assert Settings(cache_bytes=3 * GIB, device="cpu", prefix_cache=False).cache_bytes == 3 * GIB
    # the disk writer's queue is counted only with a disk tier
    with pytest.raises(ValidationError, match=r"prefix_cache_write_queue_bytes 3221225472 bytes \(prefix_cache_dir "
                       r"is set\).*REFORMER_PREFIX_CACHE_WRITE_QUEUE_BYTES"):
        Settings(prefix_cache_bytes=GIB, prefix_cache_dir=tmp_path / "pc", prefix_cache_write_queue_bytes=3 * GIB)
    assert Settings(prefix_cache_bytes=GIB, prefix_cache_write_queue_bytes=3 * GIB).prefix_cache_bytes == GIB
    fits = Settings(cache_bytes=GIB, prefix_cache_bytes=GIB, prefix_cache_dir=tmp_path / "pc",
                    prefix_cache_write_queue_bytes=GIB, device="cpu")
    assert fits.prefix_cache_host_bytes() == (GIB, GIB)
    # on CUDA the decode cache is device memory: only the prefix cache's host bytes count
    assert Settings(cache_bytes=3 * GIB, prefix_cache_bytes=2 * GIB, device="cuda").cache_bytes == 3 * GIB
    with pytest.raises(ValidationError, match="the prefix cache's memory"):
        Settings(cache_bytes=GIB, prefix_cache_bytes=4 * GIB, device="cuda")
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path / "nolimit", "max"))
    assert Settings(cache_bytes=64 * GIB, prefix_cache_bytes=64 * GIB).prefix_cache_bytes == 64 * GIB


def test_reformer_serve_refuses_a_prefix_cache_the_limit_cannot_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(memory, "CGROUP", cgroup_v2(tmp_path, str(GIB)))
    monkeypatch.setenv("REFORMER_PREFIX_CACHE_DIR", str(tmp_path / "pc"))
    monkeypatch.setenv("REFORMER_PREFIX_CACHE_BYTES", str(GIB // 8))  # the default 2 GiB queue does not fit 1 GiB
    assert server.main([]) == 2  # before any model is loaded
    err = capsys.readouterr().err
    assert "invalid settings" in err and "prefix_cache_write_queue_bytes 2147483648 bytes" in err
    assert "REFORMER_PREFIX_CACHE_WRITE_QUEUE_BYTES" in err
