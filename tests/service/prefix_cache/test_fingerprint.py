"""The cache identity names every bit a prefill's state depends on, computed at start: the C kernels on or off
and their build, the thread count, the code, torch; and leaves out what changes no stored bit (the decode
weights). Measured before: a server with REFORMER_CPU_KERNELS=off restored the entries of one with them on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model.kernels.build import KernelStatus
from service.prefix_cache import fingerprint
from service.prefix_cache.fingerprint import code_digest, runtime_fingerprint
from tests.service.helpers import running_app

CPU = torch.device("cpu")
LIMITS: dict[str, Any] = dict(max_new_tokens=8, max_input_tokens=300, prefix_cache_min_tokens=16)


def test_the_same_settings_give_the_same_fingerprint() -> None:
    assert runtime_fingerprint(CPU, True) == runtime_fingerprint(CPU, True)
    assert runtime_fingerprint(CPU, False)["kernels"] == "off"


def test_kernels_on_off_and_their_build_give_different_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    on, off = runtime_fingerprint(CPU, True), runtime_fingerprint(CPU, False)
    assert on != off
    import model.kernels as kernels

    monkeypatch.setattr(kernels, "load", lambda: KernelStatus(None, "unavailable", "no compiler"))
    unavailable = runtime_fingerprint(CPU, True)
    monkeypatch.setattr(kernels, "load", lambda: KernelStatus(None, "off", "REFORMER_CPU_KERNELS=off"))
    env_off = runtime_fingerprint(CPU, True)
    assert len({on["kernels"], unavailable["kernels"], env_off["kernels"]}) == 3


def test_a_thread_count_changes_the_fingerprint_on_the_cpu() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = runtime_fingerprint(CPU, False)
        torch.set_num_threads(2)
        two = runtime_fingerprint(CPU, False)
    finally:
        torch.set_num_threads(before)
    assert one["threads"] == "1" and two["threads"] == "2" and one != two


def test_the_code_digest_follows_the_sources(tmp_path: Any) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    first = code_digest(tmp_path)
    assert code_digest(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_digest(tmp_path) != first
    assert fingerprint.package_version() != ""


def test_servers_that_differ_in_kernels_never_share_a_key_but_decode_weights_do(artifact: Any) -> None:
    digests = {}
    for name, extra in (("on", {}), ("off", {"cpu_kernels": "off"}), ("bf16", {"decode_weights": "bfloat16"})):
        with running_app(artifact, **LIMITS, **extra) as client:
            digests[name] = client.app.state.service.engine.prefix_cache.digest  # type: ignore[attr-defined]
    assert digests["on"] != digests["off"]
    assert digests["on"] == digests["bf16"]  # the prefill runs float32 whatever the decode weights are
