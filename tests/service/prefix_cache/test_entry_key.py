"""The disk tier's HMAC key: from REFORMER_PREFIX_CACHE_KEY or a key file (a mounted Secret), at least 32
bytes, refused at start-up otherwise; without either, a random key per process; never shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.server import main
from service.api.state import prefix_cache_config
from service.prefix_cache.entry_key import MIN_KEY_BYTES, resolve_key
from service.settings import Settings


def test_the_key_comes_from_the_setting_then_the_file_then_the_process(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text("f" * MIN_KEY_BYTES + "\n")  # as `echo` leaves a Secret's value
    assert resolve_key("s" * MIN_KEY_BYTES, secret).secret == b"s" * MIN_KEY_BYTES
    from_file = resolve_key(None, secret)
    assert from_file.secret == b"f" * MIN_KEY_BYTES and from_file.source == "file"
    one, two = resolve_key(None, None), resolve_key(None, None)
    assert one.source == "per-process" and one.secret != two.secret and len(one.secret) == MIN_KEY_BYTES
    assert "f" * 8 not in repr(from_file)


def test_a_short_key_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="REFORMER_PREFIX_CACHE_KEY must be at least 32 bytes"):
        prefix_cache_config(Settings(prefix_cache_dir=tmp_path, prefix_cache_key="short"))
    short = tmp_path / "key"
    short.write_text("short")
    with pytest.raises(ValueError, match="REFORMER_PREFIX_CACHE_KEY_FILE"):
        prefix_cache_config(Settings(prefix_cache_dir=tmp_path, prefix_cache_key_file=short))


def test_a_blank_key_is_no_key_and_the_key_is_never_shown(tmp_path: Path) -> None:
    blank = Settings(prefix_cache_dir=tmp_path, prefix_cache_key="  ")
    assert blank.prefix_cache_key is None
    keyed = Settings(prefix_cache_dir=tmp_path, prefix_cache_key="k" * 40)
    assert "k" * 40 not in str(keyed.public_dict()) and keyed.public_dict()["prefix_cache_key_set"] is True


def test_the_server_refuses_to_start_with_a_short_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFORMER_PREFIX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REFORMER_PREFIX_CACHE_KEY", "too-short")
    assert main([]) == 2
    assert "REFORMER_PREFIX_CACHE_KEY must be at least 32 bytes" in capsys.readouterr().err
