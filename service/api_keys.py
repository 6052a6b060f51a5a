"""Callers' credentials: the keys the server accepts (`api_key`, and one per tenant in `api_keys_file`) and the
tenant each one names. The tenant is what `cache_salt_per_key` adds to a request's prefix-cache salt
(service/api/protocol/cache_salt.py), so callers holding different keys never share a kept state, an in-flight
prefill or a cached_tokens report, whatever they send.

The file: one `tenant:key` line per caller; blank lines and lines starting with `#` are skipped. A tenant is 1 to
64 characters of [A-Za-z0-9._@-]; a key at least 16 characters with no whitespace. A malformed line, a repeated
tenant or key, or a tenant named `default` (api_key's) is refused at start-up naming the line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"  # the tenant of `api_key`
MIN_KEY_CHARS = 16
_TENANT = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


class ApiKeysError(ValueError):
    """The keys file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class ApiKeys:
    """Accepted keys and their tenants (each key once)."""

    by_key: dict[str, str]

    def tenants(self) -> list[str]:
        return sorted(set(self.by_key.values()))


def parse_keys_file(text: str, source: str) -> dict[str, str]:
    """`tenant:key` lines -> {key: tenant}; ApiKeysError naming `source` and the line when one is bad."""
    out: dict[str, str] = {}
    tenants: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        where = f"{source} line {number}"
        if not sep:
            raise ApiKeysError(f"{where}: expected `tenant:key`")
        if not _TENANT.match(tenant):
            raise ApiKeysError(f"{where}: a tenant is 1 to 64 characters of [A-Za-z0-9._@-]")
        if tenant == DEFAULT_TENANT:
            raise ApiKeysError(f"{where}: the tenant `{DEFAULT_TENANT}` is api_key's; name this one otherwise")
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ApiKeysError(f"{where}: a key is at least {MIN_KEY_CHARS} characters with no whitespace")
        if tenant in tenants:
            raise ApiKeysError(f"{where}: tenant {tenant!r} appears twice")
        if key in out:
            raise ApiKeysError(f"{where}: this key is already tenant {out[key]!r}'s")
        tenants.add(tenant)
        out[key] = tenant
    return out


def load_api_keys(api_key: str | None, keys_file: Path | None) -> ApiKeys | None:
    """The accepted keys, or None when the server takes no key (no api_key, no file)."""
    by_key: dict[str, str] = {}
    if keys_file is not None:
        try:
            text = keys_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ApiKeysError(f"api_keys_file {keys_file}: cannot be read ({err})") from err
        by_key = parse_keys_file(text, f"api_keys_file {keys_file}")
        if not by_key:
            raise ApiKeysError(f"api_keys_file {keys_file}: holds no key")
    if api_key is not None:
        if api_key in by_key:
            raise ApiKeysError(f"api_key is also tenant {by_key[api_key]!r}'s key in api_keys_file")
        by_key[api_key] = DEFAULT_TENANT
    return ApiKeys(by_key) if by_key else None
