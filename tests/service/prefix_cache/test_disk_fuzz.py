"""A fuzzer of the disk tier: real entries, mutated 1,200 ways (truncated, bits flipped, emptied, a header
length or shape claiming gigabytes, re-signed with the right key but a wrong shape, dtype, name, header field
or logits, signed with another key), each read as the prefix cache reads its files (`read_disk`). Every one
is refused with a reason, counted once under it, deleted when its content is at fault, and never raises; a
few go through HTTP, where the answer is the cache-off server's and no response is a 500."""

from __future__ import annotations

import io
import json
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from service.prefix_cache.entry_format import TAG_FIELD, read_entry, write_entry
from service.prefix_cache.metrics import REFUSALS
from tests.service.helpers import metric_value, running_app

KEY = "fuzz-key-".ljust(40, "x")
DOC = "The harbour master kept a ledger of every ship that came in, its cargo and its crew. " * 3
QUESTION = " Who kept the ledger?"
SETTINGS: dict[str, Any] = dict(prefill="one-piece", max_new_tokens=16, max_input_tokens=600,
                                prefix_cache_min_tokens=16,
                                prefix_cache_key=KEY)
CASES = 1200

Entry = tuple[dict[str, str], dict[str, torch.Tensor]]


def _generate(client: TestClient) -> tuple[int, str, int]:
    r = client.post("/generate", json={"inputs": DOC + QUESTION, "parameters": {
        "max_new_tokens": 6, "details": True, "cache_prefix_chars": len(DOC)}})
    if r.status_code != 200:
        return r.status_code, r.text, -1
    return 200, r.json()["generated_text"], r.json()["details"]["cached_tokens"]


def _signed(entry: Entry, key: bytes = KEY.encode()) -> bytes:
    metadata, tensors = entry
    out = io.BytesIO()
    write_entry(out, tensors, {k: v for k, v in metadata.items() if k != TAG_FIELD}, key)
    return out.getvalue()


def _raw_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The file with its header JSON edited and the data left as it was (no re-signing)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def _mutations(data: bytes, entry: Entry, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(kind, bytes) pairs, each a file that must be refused (a mutation that changes nothing, such as
    flattening the 1-D logits, is left out)."""
    return ((kind, mutated) for kind, mutated in _all_mutations(data, entry, rng) if mutated != data)


def _all_mutations(data: bytes, entry: Entry, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    metadata, tensors = entry
    names = sorted(tensors)

    def resigned(**fields: str) -> Entry:
        return {**metadata, **fields}, dict(tensors)

    def with_tensor(name: str, t: torch.Tensor | None) -> bytes:
        changed = dict(tensors)
        if t is None:
            del changed[name]
        else:
            changed[name] = t
        return _signed((metadata, changed))

    fixed: list[tuple[str, bytes]] = [
        ("empty", b""),
        ("header length huge", struct.pack("<Q", 2**60) + data[8:]),
        ("header length past the end", struct.pack("<Q", len(data)) + data[8:]),
        ("other key", _signed(entry, b"another key that is long enough....")),
        ("no tag", _raw_header(data, lambda h: h["__metadata__"].pop(TAG_FIELD))),
        ("0-dim logits", with_tensor("logits", torch.tensor(1.0))),
        ("short logits", with_tensor("logits", tensors["logits"][:-1].clone())),
        ("long logits", with_tensor("logits", torch.cat([tensors["logits"], tensors["logits"][:3]]))),
        ("NaN logits", with_tensor("logits", torch.full_like(tensors["logits"], float("nan")))),
        ("float64 logits", with_tensor("logits", tensors["logits"].double())),
        ("extra tensor", with_tensor("extra.0", torch.zeros(3))),
        ("length 0", _signed(resigned(length="0"))),
        ("length huge", _signed(resigned(length=str(2**40)))),
        ("length a word", _signed(resigned(length='"many"'))),
        ("length bool", _signed(resigned(length="true"))),
        ("index_len short", _signed(resigned(index_len=json.dumps(json.loads(metadata["index_len"])[:-1])))),
        ("index_len past length", _signed(resigned(index_len=json.dumps(
            [int(metadata["length"]) + 1] * len(json.loads(metadata["index_len"])))))),
        ("num_buckets huge", _signed(resigned(num_buckets=json.dumps(
            [None if nb is None else 2**30 for nb in json.loads(metadata["num_buckets"])])))),
        ("num_buckets short", _signed(resigned(num_buckets="[]"))),
        ("ahead a bool", _signed(resigned(ahead="true"))),
        ("ahead huge", _signed(resigned(ahead=str(2**31)))),
        ("meta a list", _signed(resigned(meta="[]"))),
        ("a field missing", _signed(({k: v for k, v in metadata.items() if k != "index_len"}, tensors))),
        ("other identity", _signed(resigned(identity="0" * 64))),
        ("other key name", _signed(resigned(key="1" * 64))),
        ("expired", _signed(resigned(written_at="0"))),
        ("no written_at", _signed(({k: v for k, v in metadata.items() if k != "written_at"}, tensors))),
        ("shape claims gigabytes", _raw_header(data, lambda h: h[names[0]].update(shape=[2**38, 2]))),
        ("offsets overlap", _raw_header(data, lambda h: h[names[1]].update(data_offsets=[0, 8]))),
        ("not JSON", data[:8] + b"x" + data[9:]),
        ("metadata not strings", _raw_header(data, lambda h: h["__metadata__"].update(length=3))),
    ]
    yield from fixed
    signed_kinds: list[Callable[[], tuple[str, bytes]]] = []
    for name in names:
        t = tensors[name]
        signed_kinds += [
            lambda name=name, t=t: (f"{name} as float16", with_tensor(name, t.to(torch.float16))),
            lambda name=name, t=t: (f"{name} as int64", with_tensor(name, t.to(torch.int64))),
            lambda name=name, t=t: (f"{name} as bool", with_tensor(name, t.to(torch.bool))),
            lambda name=name, t=t: (f"{name} a row more", with_tensor(name, torch.cat([t, t[:1]]))),
            lambda name=name, t=t: (f"{name} a row less", with_tensor(name, t[1:].clone())),
            lambda name=name, t=t: (f"{name} flattened", with_tensor(name, t.reshape(-1).clone())),
            lambda name=name, t=t: (f"{name} a dim more", with_tensor(name, t.unsqueeze(0).clone())),
            lambda name=name, t=t: (f"{name} 0-dim", with_tensor(name, t.reshape(-1)[0].clone())),
            lambda name=name, t=t: (f"{name} empty", with_tensor(name, t[:0].clone())),
            lambda name=name: (f"{name} missing", with_tensor(name, None)),
            lambda name=name, t=t: (f"{name} renamed", _signed(
                (metadata, {**{k: v for k, v in tensors.items() if k != name}, name + "x": t}))),
        ]
    signed = [make() for make in signed_kinds]
    for i in range(CASES - len(fixed)):
        roll = i % 4
        if roll == 0:
            yield signed[rng.randrange(len(signed))]
        elif roll == 1:
            cut = rng.randrange(len(data))
            yield f"truncated at {cut}", data[:cut]
        else:
            flipped = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            yield "bits flipped", bytes(flipped)


@pytest.fixture(scope="module")
def server(artifact: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path, str]]:
    folder = tmp_path_factory.mktemp("fuzz-cache")
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        want = _generate(off)
    with running_app(artifact, **SETTINGS, prefix_cache_dir=folder) as client:
        assert _generate(client) == (200, want[1], 0)
        client.app.state.service.engine.prefix_cache.flush()  # type: ignore[attr-defined]
        yield client, folder, want[1]


def test_every_mutated_entry_is_refused_by_reason_and_never_raises(server: tuple[TestClient, Path, str]) -> None:
    client, folder, _ = server
    engine = client.app.state.service.engine  # type: ignore[attr-defined]
    cache = engine.prefix_cache
    (path,) = folder.glob("*.safetensors")
    key = path.name.removesuffix(".safetensors")
    data = path.read_bytes()
    with open(path, "rb") as f:
        entry = read_entry(f, path.name, KEY.encode(), lambda m, s: None)
    refusals = cache.metrics.disk_refusals
    seen: dict[str, int] = {}
    cases = 0
    with engine._cond:  # the worker idle meanwhile: the lookups below are its own
        for kind, mutated in _mutations(data, entry, random.Random(63)):
            before = {r: refusals.labels(r)._value.get() for r in REFUSALS}
            path.write_bytes(mutated)
            cache.store.clear()
            found = cache.read_disk(key, engine.runner.cache)
            after = {r: refusals.labels(r)._value.get() for r in REFUSALS}
            counted = [r for r in REFUSALS if after[r] != before[r]]
            assert found is None, kind
            assert len(counted) == 1 and after[counted[0]] == before[counted[0]] + 1, (kind, counted)
            assert counted[0] != "io", kind  # every fault here is the file's content ...
            assert not path.exists(), kind  # ... so the file is gone
            seen[counted[0]] = seen.get(counted[0], 0) + 1
            cases += 1
        path.write_bytes(data)  # the real entry is still read, and restored
        cache.store.clear()
        assert cache.read_disk(key, engine.runner.cache) is not None
    assert cases >= 1000
    assert {"corrupt", "unauthenticated", "foreign", "expired", "layout", "logits"} <= set(seen), seen


def test_a_read_that_fails_is_counted_as_io_and_keeps_the_file(server: tuple[TestClient, Path, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO or ESTALE on a shared folder is no sign the file is bad: it stays for the next read."""
    import builtins
    import errno

    client, folder, _ = server
    engine = client.app.state.service.engine  # type: ignore[attr-defined]
    cache = engine.prefix_cache
    (path,) = folder.glob("*.safetensors")
    real_open = builtins.open

    def failing(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == str(path):
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(file, *args, **kwargs)

    before = cache.metrics.disk_refusals.labels("io")._value.get()
    with engine._cond:
        cache.store.clear()
        monkeypatch.setattr(builtins, "open", failing)
        found = cache.read_disk(path.name.removesuffix(".safetensors"), engine.runner.cache)
        monkeypatch.undo()
    assert found is None and path.exists()
    assert cache.metrics.disk_refusals.labels("io")._value.get() == before + 1


@pytest.mark.parametrize("kind", ["0-dim logits", "short logits", "index_len short", "bits flipped", "empty",
                                  "length huge", "recent.1 a row more"])
def test_through_http_a_planted_file_never_fails_a_request(server: tuple[TestClient, Path, str], kind: str) -> None:
    client, folder, want = server
    (path,) = folder.glob("*.safetensors")
    data = path.read_bytes()
    with open(path, "rb") as f:
        entry = read_entry(f, path.name, KEY.encode(), lambda m, s: None)
    mutated = next(m for k, m in _mutations(data, entry, random.Random(1)) if k == kind)
    engine = client.app.state.service.engine  # type: ignore[attr-defined]
    with engine._cond:
        engine.prefix_cache.store.clear()
        path.write_bytes(mutated)
    status, text, cached = _generate(client)
    assert (status, text, cached) == (200, want, 0)  # refused: prefilled, the cache-off answer
    engine.prefix_cache.flush()
    status, text, cached = _generate(client)  # the rewritten entry serves the next one
    assert (status, text, cached) == (200, want, len(DOC))
    assert metric_value(client.get("/metrics").text, "reformer_prefix_cache_disk_refusals_total",
                        {"reason": "io"}) <= 1
