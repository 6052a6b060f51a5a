"""The key that authenticates disk entries (service/prefix_cache/entry_format.py): REFORMER_PREFIX_CACHE_KEY,
or the contents of REFORMER_PREFIX_CACHE_KEY_FILE (a mounted Kubernetes Secret), shared by every replica that
shares the folder.

Without either, each process draws a random key: its entries are readable by itself only (a restarted server
or another replica refuses them as unauthenticated and overwrites them), so an unconfigured folder is never a
way to plant a state. The key is never logged or shown; /info says only where it came from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIN_KEY_BYTES = 32  # 256 bits, the HMAC-SHA256 block's worth of secret


@dataclass(frozen=True)
class EntryKey:
    secret: bytes
    source: str  # "setting", "file" or "per-process"

    def __repr__(self) -> str:  # never the secret
        return f"EntryKey(source={self.source!r})"


def key_problem(secret: bytes, where: str) -> str | None:
    """Why `secret` cannot be a key, or None."""
    if len(secret) < MIN_KEY_BYTES:
        return f"{where} must be at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`); got {len(secret)}"
    return None


def read_key_file(path: Path) -> bytes:
    """The file's bytes without surrounding whitespace (a Secret written by `echo` ends in a newline)."""
    return path.read_bytes().strip()


def resolve_key(value: str | None, path: Path | None) -> EntryKey:
    """The configured key (ValueError naming the setting when it is too short), else a per-process one."""
    if value:
        secret = value.strip().encode()
        problem = key_problem(secret, "REFORMER_PREFIX_CACHE_KEY")
        if problem:
            raise ValueError(problem)
        return EntryKey(secret, "setting")
    if path is not None:
        secret = read_key_file(path)
        problem = key_problem(secret, f"REFORMER_PREFIX_CACHE_KEY_FILE {path}")
        if problem:
            raise ValueError(problem)
        return EntryKey(secret, "file")
    return EntryKey(os.urandom(MIN_KEY_BYTES), "per-process")
