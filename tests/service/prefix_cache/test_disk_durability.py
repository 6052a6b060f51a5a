"""The disk tier's upkeep: files fsynced around the rename, temporary files counted in the cap and swept by
age, a time to live on both tiers, a write queue bounded in bytes (with its gauge), disk_writes counting only
files written, and no lookups below the minimum length."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from model.decoding.snapshot import StateSnapshot
from service.prefix_cache import PrefixCache, PrefixCacheConfig
from service.prefix_cache import disk as disk_module
from service.prefix_cache import store as store_module
from service.prefix_cache.disk import TEMP_MAX_AGE_S, TEMP_PREFIX, DiskTier, EntryFault
from service.prefix_cache.entry_key import EntryKey
from service.prefix_cache.keys import CacheIdentity
from service.prefix_cache.metrics import PrefixCacheMetrics
from service.prefix_cache.store import PrefixStore
from tests.service.prefix_cache.folders import held_writes

KEY = EntryKey(b"d" * 32, "setting")
ANY: Any = lambda metadata, shapes: None  # noqa: E731 (the layout is not what these tests are about)


def _snapshot(length: int = 20, numel: int = 1000) -> StateSnapshot:
    return StateSnapshot(length=length, num_buckets=[None], index_len=[0],
                         tensors={"logits": torch.randn(7), "kv.0": torch.randn(numel)})


def _key(i: int) -> str:
    return f"{i:064x}"


def test_a_write_fsyncs_the_file_and_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(disk_module.os, "fsync", fsync)
    tier = DiskTier(tmp_path, 2**30, "ab" * 32, KEY)
    tier.write(_key(1), _snapshot())
    assert len(synced) == 2
    assert Path(synced[0]).name.startswith(TEMP_PREFIX)  # the file's bytes, before the rename
    assert Path(synced[1]) == tmp_path.resolve()  # the folder, after it


def test_temporary_files_count_in_the_cap_and_stale_ones_are_swept(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 2**30, "ab" * 32, KEY)
    size = tier.write(_key(1), _snapshot())
    fresh = tmp_path / f"{TEMP_PREFIX}fresh.safetensors"
    fresh.write_bytes(b"\0" * size)
    assert tier.used_bytes == 2 * size
    stale = tmp_path / f"{TEMP_PREFIX}stale.safetensors"
    stale.write_bytes(b"\0" * 10)
    old = time.time() - TEMP_MAX_AGE_S - 1
    os.utime(stale, (old, old))
    tier.capacity_bytes = size + size // 2  # room for one entry, but a write in flight takes a share
    assert tier.trim() == 2  # the stale temporary file, and the entry the fresh one crowds out
    assert not stale.exists() and fresh.exists() and not tier.has(_key(1))


def test_a_disk_entry_past_its_time_to_live_is_refused_and_swept(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 2**30, "ab" * 32, KEY, ttl_s=60)
    tier.write(_key(1), _snapshot())
    tier.write(_key(2), _snapshot())
    assert tier.read(_key(1), ANY) is not None
    now = time.time()
    monkeypatch.setattr(disk_module.time, "time", lambda: now + 61)
    with pytest.raises(EntryFault) as refused:
        tier.read(_key(1), ANY)
    assert refused.value.reason == "expired" and not tier.has(_key(1))
    old = now - 61
    os.utime(tier.path(_key(2)), (old, old))
    monkeypatch.setattr(disk_module.time, "time", lambda: now)
    assert tier.trim() == 1 and not tier.has(_key(2))


def test_a_memory_entry_past_its_time_to_live_is_not_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now[0])
    store = PrefixStore(10**7, ttl_s=30)
    store.put("a", _snapshot())
    now[0] += 29
    assert store.get("a") is not None
    now[0] += 2
    assert store.get("a") is None and "a" not in store
    store.check()


def _cache(tmp_path: Path, **config: Any) -> tuple[PrefixCache, PrefixCacheMetrics]:
    metrics = PrefixCacheMetrics(CollectorRegistry())
    identity = CacheIdentity("sha", 1, "float32", "float32", "cpu", 64, False)
    cache = PrefixCache(identity, PrefixCacheConfig(10**7, min_tokens=16, disk_dir=tmp_path, key=KEY, **config),
                        metrics, vocab_size=7)
    return cache, metrics


def test_disk_writes_count_files_written_not_writes_skipped(tmp_path: Path) -> None:
    cache, metrics = _cache(tmp_path)
    try:
        snap = _snapshot()
        cache.offer(_key(1), snap)
        cache.flush()
        cache.store.clear()
        cache.offer(_key(1), snap)  # the file is there: nothing written
        cache.flush()
        assert metrics.disk_writes._value.get() == 1
        assert cache.queued_bytes == 0
    finally:
        cache.close()


def test_the_write_queue_is_bounded_in_bytes(tmp_path: Path) -> None:
    snap = _snapshot()
    cache, metrics = _cache(tmp_path, write_queue_bytes=snap.nbytes - 1)
    try:
        assert cache.offer(_key(1), snap)  # kept in memory ...
        cache.flush()
        assert not cache.disk.has(_key(1))  # type: ignore[union-attr]  # ... but not written
        assert metrics.disk_refusals.labels("queue_full")._value.get() == 1
        assert "reformer_prefix_cache_disk_queue_bytes" in {m.name for m in metrics.collect()}
    finally:
        cache.close()


def test_a_prompt_below_the_minimum_is_not_looked_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, metrics = _cache(tmp_path)
    try:
        def no_read(*args: Any) -> None:
            raise AssertionError("the disk was read for a prompt too short to be kept")

        monkeypatch.setattr(cache.disk, "read", no_read)
        assert not cache.wants_read_ahead(_key(1), 15)
        assert cache.lookup(_key(1), 15) is None
        assert metrics.queries._value.get() == 0
    finally:
        cache.close()


def test_shutdown_waits_for_queued_writes_within_a_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A hung folder (a write that does not return) once made shutdown wait for ever: close() waited on the
    write queue with no limit. Now it waits at most its timeout, says what was not written, and goes."""
    real = DiskTier.write
    release = held_writes(monkeypatch, 30)
    cache, _ = _cache(tmp_path)
    try:
        cache.offer(_key(1), _snapshot())
        cache.offer(_key(2), _snapshot())
        assert not cache.flush(0.05)
        began = time.monotonic()
        cache.close(timeout_s=0.3)
        took = time.monotonic() - began
        assert 0.3 <= took < 3
        assert "prefix cache writes" in caplog.text and "not written" in caplog.text
    finally:
        release.set()
    cache.flush(10)  # the writer, released, finishes what it held
    assert cache.queued_bytes == 0 and cache.disk.has(_key(1))  # type: ignore[union-attr]
    # with writes that finish, close() waits for them: every queued state is written
    monkeypatch.setattr(DiskTier, "write", real)
    other, _ = _cache(tmp_path / "b")
    other.offer(_key(3), _snapshot())
    other.close(timeout_s=10)
    assert other.disk.has(_key(3))  # type: ignore[union-attr]
