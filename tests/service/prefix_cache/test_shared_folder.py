"""Real server processes sharing one disk-tier folder, as replicas do (docs/DEPLOY.md): a state one computed
is served by another with the same key and the same runtime, bit for bit; a server with another HMAC key
refuses the files (counted as unauthenticated) and answers from its cold path; servers whose runtime differs
(the C kernels off, another thread count) never use each other's entries (their keys differ: a miss, not a
refusal); two servers writing one prompt's state at once leave one good file."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.prefix_cache.disk import SUFFIX, TEMP_PREFIX
from service.prefix_cache.entry_format import read_entry
from tests.service.conftest import ServerProcess
from tests.service.helpers import metric_value

pytestmark = pytest.mark.xdist_group("prefix-cache-shared-folder")

KEY = "shared-folder-key-" + "k" * 32
OTHER_KEY = "another-replicas-key-" + "o" * 32
SETTINGS: dict[str, Any] = dict(backend="torch", prefill="one-piece", max_new_tokens=16, max_input_tokens=600,
                                prefix_cache_min_tokens=16)
PROMPT = "The harbour master kept a ledger of every ship that came in, its cargo and its crew. " * 5
RACED = "In the valley the river turned twice before it reached the mill, where the miller's daughter waited. " * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-prefix-cache")


@pytest.fixture(scope="module")
def servers(tiny_artifact: Path, folder: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, ServerProcess]]:
    """a and b: the same key and runtime; other_key: another HMAC key; kernels_off: REFORMER_CPU_KERNELS=off;
    two_threads: two intra-op threads. All started at once on the same folder."""
    variants: dict[str, dict[str, Any]] = {
        "a": dict(prefix_cache_key=KEY),
        "b": dict(prefix_cache_key=KEY),
        "other_key": dict(prefix_cache_key=OTHER_KEY),
        "kernels_off": dict(prefix_cache_key=KEY, cpu_kernels="off"),
        "two_threads": dict(prefix_cache_key=KEY, threads=2),
    }
    started: dict[str, ServerProcess] = {}
    try:
        for name, extra in variants.items():
            log_path = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
            started[name] = ServerProcess(tiny_artifact, log_path, **SETTINGS, prefix_cache_dir=folder, **extra)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def _complete(server: ServerProcess, prompt: str) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                         "logprobs": 2}, timeout=60)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _answer(body: dict[str, Any]) -> tuple[str, list[float], list[dict[str, float]]]:
    choice = body["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _metrics(server: ServerProcess) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _counts(server: ServerProcess) -> dict[str, float]:
    text = _metrics(server)
    counts = {"disk_hits": metric_value(text, "reformer_prefix_cache_hits_tokens_total", {"tier": "disk"}),
              "disk_reads": metric_value(text, "reformer_prefix_cache_disk_reads_total"),
              "queued": metric_value(text, "reformer_prefix_cache_disk_queue_bytes")}
    for reason in ("unauthenticated", "foreign", "corrupt", "layout", "io"):
        counts[reason] = metric_value(text, "reformer_prefix_cache_disk_refusals_total", {"reason": reason})
    return counts


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.glob(f"*{SUFFIX}") if not p.name.startswith(".")}


def _settled(folder: Path, *servers: ServerProcess, timeout: float = 20.0) -> None:
    """Every queued disk write of `servers` is done and no temporary file is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_counts(s)["queued"] == 0 for s in servers) and not list(folder.glob(f"{TEMP_PREFIX}*")):
            return
        time.sleep(0.05)
    raise AssertionError("disk writes did not finish")


def test_replicas_share_states_only_with_the_same_key_and_runtime(servers: dict[str, ServerProcess],
                                                                   folder: Path) -> None:
    a, b = servers["a"], servers["b"]
    _settled(folder, *servers.values())  # the warm-ups' writes
    before = {name: _counts(s) for name, s in servers.items()}
    entries_before = _entries(folder)

    first = _complete(a, PROMPT)
    _settled(folder, a)
    written = _entries(folder) - entries_before
    assert _cached(first) == 0 and len(written) == 1

    # the same key and runtime: b restores a's state from the folder, and answers a's bits
    second = _complete(b, PROMPT)
    assert _cached(second) == len(PROMPT)  # byte tokens: one per character
    assert _answer(second) == _answer(first)
    after_b = _counts(b)
    assert after_b["disk_hits"] - before["b"]["disk_hits"] == len(PROMPT)
    assert after_b["disk_reads"] - before["b"]["disk_reads"] == 1

    # another runtime: another key, so a's file is never read (a miss, not a refusal); each writes its own
    for name in ("kernels_off", "two_threads"):
        body = _complete(servers[name], PROMPT)
        now = _counts(servers[name])
        assert _cached(body) == 0, name
        assert now["disk_hits"] == before[name]["disk_hits"] and now["disk_reads"] == before[name]["disk_reads"]
        assert all(now[r] == before[name][r] for r in ("unauthenticated", "foreign", "corrupt", "layout")), name
    _settled(folder, servers["kernels_off"], servers["two_threads"])
    assert len(_entries(folder) - entries_before) == 3  # a's, kernels_off's and two_threads'

    # another HMAC key: a's file fails its tag, is refused and counted, and the answer is the cold path's
    other = servers["other_key"]
    third = _complete(other, PROMPT)
    now = _counts(other)
    assert _cached(third) == 0
    assert now["unauthenticated"] - before["other_key"]["unauthenticated"] == 1
    assert now["disk_hits"] == before["other_key"]["disk_hits"]
    assert _answer(third) == _answer(first)  # its cold path is a's: same runtime


def test_two_servers_writing_one_prompt_at_once_leave_one_good_file(servers: dict[str, ServerProcess],
                                                                     folder: Path) -> None:
    a, b = servers["a"], servers["b"]
    _settled(folder, a, b)
    entries_before = _entries(folder)
    answers: dict[str, dict[str, Any]] = {}
    go = threading.Barrier(2)

    def ask(name: str) -> None:
        go.wait()
        answers[name] = _complete(servers[name], RACED)

    threads = [threading.Thread(target=ask, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    _settled(folder, a, b)
    assert _answer(answers["a"]) == _answer(answers["b"])
    new = _entries(folder) - entries_before
    assert len(new) == 1 and not list(folder.glob(f"{TEMP_PREFIX}*"))
    with open(folder / next(iter(new)), "rb") as f:  # whole and authentic under the shared key
        metadata, tensors = read_entry(f, "raced", KEY.encode(), lambda m, s: None)
    assert int(metadata["length"]) == len(RACED) and tensors["logits"].numel() > 0
    # and a third request, to either, is a hit with the same answer
    again = _complete(b, RACED)
    assert _cached(again) == len(RACED) and _answer(again) == _answer(answers["a"])
