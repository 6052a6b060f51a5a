"""The prefix cache's trust and isolation settings (docs/DEPLOY.md, "The prefix cache's threat model"): the disk
tier's HMAC key, the tiers' times to live, the disk writer's queue, and whether callers are told of hits. A
part of `service.settings.Settings` (REFORMER_ variables, flags, the README's table), kept apart so that the
prefix cache's trust work stays in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, field_validator

# The prefix cache's memory tier when prefix_cache_bytes is unset: this share of the decode cache's capacity
# (service/engine/runner.py `default_prefix_cache_bytes`; on CUDA at most a share of the host's free memory too).
PREFIX_CACHE_SHARE = 0.5


def blank_is_none(value: Any) -> Any:
    """A secret setting's value before validation, None when blank: an empty variable, as templated env files and
    Kubernetes Secrets often leave it, is no key."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, str) and not value.strip():
        return None
    return value


class PrefixCacheTrustSettings(BaseModel):
    prefix_cache_key: SecretStr | None = Field(
        None,
        description="The key (at least 32 bytes, e.g. `openssl rand -hex 32`) that authenticates the disk tier's "
        "files with HMAC-SHA256: every replica sharing prefix_cache_dir needs the same one. Unset, and no "
        "prefix_cache_key_file: each process draws a random key, so its files are read by itself only (a "
        "restarted server or another replica refuses them and writes its own).",
    )
    prefix_cache_key_file: Path | None = Field(
        None,
        description="A file holding prefix_cache_key (a mounted Kubernetes Secret); surrounding whitespace is "
        "ignored. prefix_cache_key, when set, wins.",
    )
    prefix_cache_ttl_s: float | None = Field(
        None, gt=0,
        description="The memory tier's time to live: a state stored longer ago is no longer restored. Unset: kept "
        "until evicted.",
    )
    prefix_cache_dir_ttl_s: float = Field(
        86400.0, ge=0,
        description="The disk tier's time to live: a file written longer ago is refused (reason expired) and "
        "deleted, and the folder's trim deletes files untouched for as long. 0: no limit.",
    )
    prefix_cache_write_queue_bytes: int = Field(
        2 * 2**30, ge=0,
        description="States waiting for the disk writer, in bytes: a state that would take the queue past it "
        "is kept in memory only (reformer_prefix_cache_disk_refusals_total{reason=\"queue_full\"}).",
    )
    prefix_cache_report: bool = Field(
        True,
        description="Report prefix-cache hits to callers (usage.prompt_tokens_details.cached_tokens, "
        "details.cached_tokens and the x-cached-tokens header). false: they always say 0 and the header is not "
        "sent, so a caller cannot learn from them whether another sent the same document (timing still can; "
        "cache_salt is the isolation: docs/API.md).",
    )

    @field_validator("prefix_cache_key", mode="before")
    @classmethod
    def _blank_cache_key_is_no_key(cls, value: Any) -> Any:
        return blank_is_none(value)  # no key: a per-process one is drawn
