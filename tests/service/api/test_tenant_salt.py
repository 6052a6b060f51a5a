"""cache_salt_per_key: callers holding different keys (api_keys_file) never share a kept state or a
cached_tokens report, whatever salt they send; one key's caller still reuses its own document; with the setting
off, the keys do not split the cache. Wrong keys get 401."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.service.helpers import running_app

DOC = "In the valley the river turned twice before it reached the mill, where the miller's daughter waited. " * 3
KEY_A, KEY_B = "alpha-key-0123456789abcdef", "bravo-key-0123456789abcdef"
SETTINGS: dict[str, Any] = dict(max_new_tokens=8, max_input_tokens=800, prefix_cache_min_tokens=16)


def _cached(client: Any, key: str, question: str, salt: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}", **({"X-Cache-Salt": salt} if salt else {})}
    r = client.post("/generate", headers=headers, json={"inputs": DOC + question, "parameters": {
        "max_new_tokens": 2, "details": True}})
    assert r.status_code == 200, r.text
    return int(r.json()["details"]["cached_tokens"])


def _keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"acme:{KEY_A}\nglobex:{KEY_B}\n")
    return path


def test_tenants_never_share_a_cached_document(artifact: Any, tmp_path: Path) -> None:
    with running_app(artifact, api_keys_file=_keys(tmp_path), **SETTINGS) as client:
        assert _cached(client, KEY_A, " Who?") == 0
        # the same document and salt under another key: nothing is reported or reused
        assert _cached(client, KEY_B, " Who?") == 0
        # the same explicit salt under both keys: still nothing shared (the tenant joins the salt, not replaced)
        assert _cached(client, KEY_A, " Who?", salt="shared") == 0
        assert _cached(client, KEY_B, " Who?", salt="shared") == 0
        assert _cached(client, KEY_A, " Who?", salt="shared") > 0
        assert _cached(client, KEY_A, " Who?") > 0  # the tenant's own repeat is a hit
        r = client.post("/generate", headers={"Authorization": "Bearer not-a-key-0123456789"},
                        json={"inputs": DOC, "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 401


def test_without_per_key_salts_the_keys_share(artifact: Any, tmp_path: Path) -> None:
    with running_app(artifact, api_keys_file=_keys(tmp_path), cache_salt_per_key=False, **SETTINGS) as client:
        assert _cached(client, KEY_A, " Who?") == 0
        assert _cached(client, KEY_B, " Who?") > 0
