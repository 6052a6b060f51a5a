"""The disk tier's folder failing at run time: removed under the server, full (ENOSPC on every write), or slow
(a write that does not return until released). Every request still answers 200 with the cache-off answer, the
failed writes are counted, and a slow folder never holds a request back (writes run on the writer's thread).
And two writers of one key at once leave one good file."""

from __future__ import annotations

import errno
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from model.decoding.snapshot_layout import check_layout
from service.prefix_cache import disk as disk_module
from service.prefix_cache.disk import DiskTier
from service.prefix_cache.entry_key import resolve_key
from tests.service.helpers import metric_value, running_app
from tests.service.prefix_cache.folders import held_writes
from tests.service.prefix_cache.test_prefix_cache import DOCS, KEY, LIMITS, QUESTIONS, _generate


def _answers(client: Any) -> list[tuple[str, int]]:
    return [_generate(client, DOCS[0] + q, len(DOCS[0])) for q in QUESTIONS[:2]]


@pytest.fixture(scope="module")
def cold(artifact: Any) -> list[str]:
    with running_app(artifact, **LIMITS, prefix_cache=False) as off:
        return [text for text, _ in _answers(off)]


def test_a_folder_removed_under_the_server_fails_writes_not_requests(artifact: Any, tmp_path: Path,
                                                                      cold: list[str]) -> None:
    folder = tmp_path / "shared"
    with running_app(artifact, **LIMITS, prefix_cache_dir=folder, prefix_cache_key=KEY) as client:
        shutil.rmtree(folder)
        got = _answers(client)
        client.app.state.service.engine.prefix_cache.flush()  # type: ignore[attr-defined]
        metrics = client.get("/metrics").text
    assert [text for text, _ in got] == cold
    assert got[1][1] == len(DOCS[0])  # the memory tier still serves the second question
    assert metric_value(metrics, "reformer_prefix_cache_disk_refusals_total", {"reason": "write_failed"}) >= 1


def test_a_full_folder_fails_writes_not_requests(artifact: Any, tmp_path: Path, cold: list[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "write_entry", full)
    with running_app(artifact, **LIMITS, prefix_cache_dir=tmp_path, prefix_cache_key=KEY) as client:
        got = _answers(client)
        client.app.state.service.engine.prefix_cache.flush()  # type: ignore[attr-defined]
        metrics = client.get("/metrics").text
    assert [text for text, _ in got] == cold
    assert metric_value(metrics, "reformer_prefix_cache_disk_refusals_total", {"reason": "disk_full"}) >= 1
    assert not list(tmp_path.iterdir())  # no file, and no temporary file left behind


def test_a_slow_folder_holds_no_request_back(artifact: Any, tmp_path: Path, cold: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    release = held_writes(monkeypatch, 60)
    with running_app(artifact, **LIMITS, prefix_cache_dir=tmp_path, prefix_cache_key=KEY) as client:
        got = _answers(client)  # answered while the first write still waits
        waiting = not release.is_set()
        release.set()
        client.app.state.service.engine.prefix_cache.flush()  # type: ignore[attr-defined]
    assert waiting and [text for text, _ in got] == cold
    assert got[1][1] == len(DOCS[0])
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_two_writers_of_one_key_leave_one_good_file(artifact: Any, tmp_path: Path) -> None:
    with running_app(artifact, **LIMITS) as client:
        _generate(client, DOCS[1] + QUESTIONS[0])
        engine = client.app.state.service.engine  # type: ignore[attr-defined]
        store = engine.prefix_cache.store
        key = next(iter(store._entries))
        snap = store.get(key)
        cache = engine.runner.cache
        digest = engine.prefix_cache.digest
        vocab = engine.prefix_cache.vocab_size
        tiers = [DiskTier(tmp_path, 2**30, digest, resolve_key(KEY, None), None) for _ in range(2)]
        start = threading.Barrier(2)

        def write(tier: DiskTier) -> None:
            start.wait()
            tier.write(key, snap)

        threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        files = list(tmp_path.iterdir())
        read = tiers[0].read(key, lambda m, s: check_layout(cache, m, s, vocab))
    assert [f.name for f in files] == [f"{key}.safetensors"]
    assert read is not None and read.length == snap.length
    assert all(read.tensors[name].equal(t) for name, t in snap.tensors.items())
