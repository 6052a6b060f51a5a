"""The disk tier on real failing folders (tests/service/prefix_cache/folders.py): a tmpfs remounted read-only
under the running server, and a tmpfs filled to its last page. Requests keep answering 200 with the cache-off
answers, each failed write is counted under its reason (read_only, disk_full) and leaves no temporary file,
the entries already there stay and are still served, and a file refused on a read-only folder (which cannot
be deleted) is refused under its own reason, not as an I/O fault. Where this process may not mount, the
folders fall back as folders.py says (the test then proves less, said where it matters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.prefix_cache.disk import SUFFIX, TEMP_PREFIX
from tests.service.helpers import metric_value, running_app
from tests.service.prefix_cache.folders import failing_folder
from tests.service.prefix_cache.test_prefix_cache import DOCS, KEY, LIMITS, QUESTIONS, _generate

DOC_C = "At dawn the lighthouse keeper counted the boats returning, and wrote each name in chalk on the door. " * 3
PROMPTS = [(DOCS[0], QUESTIONS[0]), (DOCS[0], QUESTIONS[1]), (DOCS[1], QUESTIONS[0]), (DOCS[1], QUESTIONS[1]),
           (DOC_C, QUESTIONS[0]), (DOC_C, QUESTIONS[1])]
MIB = 1 << 20


@pytest.fixture(scope="module")
def cold(artifact: Any) -> dict[tuple[str, str], str]:
    with running_app(artifact, **LIMITS, prefix_cache=False) as off:
        return {(doc, q): _generate(off, doc + q, len(doc))[0] for doc, q in PROMPTS}


def _ask(client: Any, doc: str, q: str) -> tuple[str, int]:
    return _generate(client, doc + q, len(doc))


def _refusals(metrics: str, reason: str) -> float:
    return metric_value(metrics, "reformer_prefix_cache_disk_refusals_total", {"reason": reason})


def _entries(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob(f"*{SUFFIX}")}


def test_a_folder_made_read_only_fails_writes_not_requests(artifact: Any, tmp_path: Path,
                                                           cold: dict[tuple[str, str], str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with failing_folder(tmp_path / "shared", 4 * MIB, monkeypatch) as folder, \
            running_app(artifact, **LIMITS, prefix_cache_dir=folder.path, prefix_cache_key=KEY) as client:
        cache = client.app.state.service.engine.prefix_cache  # type: ignore[attr-defined]
        a = _ask(client, DOCS[0], QUESTIONS[0])
        cache.flush()
        name_a = set(_entries(folder.path))
        b = _ask(client, DOCS[1], QUESTIONS[0])
        cache.flush()
        written = _entries(folder.path)
        assert len(name_a) == 1 and len(written) == 2
        name_b = next(n for n in written if n not in name_a)
        damaged = bytearray(written[name_b])
        damaged[-1] ^= 0xFF  # fails its HMAC
        (folder.path / name_b).write_bytes(bytes(damaged))

        folder.make_read_only()
        cache.store.clear()  # memory forgets: what follows reads the folder
        from_disk = _ask(client, DOCS[0], QUESTIONS[1])  # still served from the read-only folder
        refused = _ask(client, DOCS[1], QUESTIONS[1])  # refused; cannot be deleted there
        new = [_ask(client, DOC_C, q) for q in QUESTIONS[:2]]  # its write fails; memory still serves it
        cache.flush()
        metrics = client.get("/metrics").text
        after = _entries(folder.path)
        temps = list(folder.path.glob(f"{TEMP_PREFIX}*"))
    assert a[0] == cold[(DOCS[0], QUESTIONS[0])] and b[0] == cold[(DOCS[1], QUESTIONS[0])]
    assert from_disk == (cold[(DOCS[0], QUESTIONS[1])], len(DOCS[0]))
    assert refused == (cold[(DOCS[1], QUESTIONS[1])], 0)
    assert [text for text, _ in new] == [cold[(DOC_C, q)] for q in QUESTIONS[:2]]
    assert [cached for _, cached in new] == [0, len(DOC_C)]
    assert _refusals(metrics, "unauthenticated") == 1 and _refusals(metrics, "io") == 0
    assert _refusals(metrics, "read_only") >= 1
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "disk"}) == len(DOCS[0])
    assert not temps
    others = {n: data for n, data in written.items() if n != name_b}
    assert all(after[n] == data for n, data in others.items())  # the good entry is untouched
    if folder.really_read_only:  # a simulated folder lets the refused file be deleted
        assert set(after) == set(written)


def test_a_full_filesystem_fails_writes_not_requests(artifact: Any, tmp_path: Path,
                                                     cold: dict[tuple[str, str], str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with failing_folder(tmp_path / "small", 2 * MIB, monkeypatch) as folder, \
            running_app(artifact, **LIMITS, prefix_cache_dir=folder.path, prefix_cache_key=KEY) as client:
        cache = client.app.state.service.engine.prefix_cache  # type: ignore[attr-defined]
        a = _ask(client, DOCS[0], QUESTIONS[0])
        cache.flush()
        written = _entries(folder.path)
        assert len(written) == 1
        filled = folder.fill()
        assert filled > 0 or not folder.really_full

        cache.store.clear()
        from_disk = _ask(client, DOCS[0], QUESTIONS[1])  # the full folder still serves what it holds
        new = [_ask(client, DOC_C, q) for q in QUESTIONS[:2]]  # its write fails
        cache.flush()
        metrics = client.get("/metrics").text
        full = _entries(folder.path)
        temps = list(folder.path.glob(f"{TEMP_PREFIX}*"))
        if folder.really_full:  # room again: the next write of the same state lands
            (folder.path / "filler").unlink()
            cache.store.clear()
            again = _ask(client, DOC_C, QUESTIONS[0])
            cache.flush()
            assert again == (cold[(DOC_C, QUESTIONS[0])], 0) and len(_entries(folder.path)) == 2
    assert a[0] == cold[(DOCS[0], QUESTIONS[0])]
    assert from_disk == (cold[(DOCS[0], QUESTIONS[1])], len(DOCS[0]))
    assert [text for text, _ in new] == [cold[(DOC_C, q)] for q in QUESTIONS[:2]]
    assert [cached for _, cached in new] == [0, len(DOC_C)]
    assert _refusals(metrics, "disk_full") >= 1 and _refusals(metrics, "write_failed") == 0
    assert full == written and not temps  # nothing deleted to make room, nothing half-written left

