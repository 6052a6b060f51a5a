"""What a cached prefix is looked up by: a hash chain over the token blocks, started from everything that
changes the bits of a decode state (the artifact and the settings), so that two servers agree on a key exactly
when a state computed by one is the state the other would compute."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# tokens per link of the chain: a key is the chain's value after a prompt's last (possibly partial) block
KEY_BLOCK_TOKENS = 256

assert array("i").itemsize == 4 and int.from_bytes(array("i", [1]).tobytes(), "little") == 1


@dataclass(frozen=True)
class CacheIdentity:
    """Everything a decode state's bits depend on besides the tokens: the artifact (its weights' sha256 and the
    whole model config, hash seed included), each setting that changes what a prefill writes or how the state
    is laid out, and the code and machine that compute it (`runtime`: service/prefix_cache/fingerprint.py). The
    decode weights are not in it: the prefill runs float32 whatever they are, so they change no stored bit, and
    servers that differ only there share states. A state is only ever reused under the same identity."""

    artifact_sha256: str
    hash_seed: int | None
    model_dtype: str
    kv_cache_dtype: str
    device_type: str
    recent_size: int  # the LSH indexes' recent order: its length is part of a state
    batch_invariant: bool  # prompts prefilled alone (bit for bit) or grouped with others
    config_digest: str = ""  # the model config (chunk lengths, bucket counts, layers): `config_digest_of`
    runtime: str = ""  # `fingerprint.runtime_fingerprint` as sorted JSON
    layout_version: int = 1  # bumped when what a snapshot holds changes (model/decoding/snapshot.py)
    prefill: str = "one-piece"  # how prompts are read (REFORMER_PREFILL): a causal state is another state

    @staticmethod
    def config_digest_of(config: object) -> str:
        """sha256 of a model config dataclass's fields, as sorted JSON."""
        fields = asdict(config)  # type: ignore[call-overload]
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


MAX_SALT_CHARS = 256


def chain_start(identity_digest: str, salt: str | None = None) -> bytes:
    """The chain's first link: the identity, or with a cache salt (a tenant's, service/api/protocol/cache_salt.py)
    sha256 over the identity and the salt, so that different salts never reach the same key."""
    link = bytes.fromhex(identity_digest)
    if salt:
        data = salt.encode()
        link = hashlib.sha256(b"cache-salt\0" + link + len(data).to_bytes(4, "little") + data).digest()
    return link


def chain_key(identity_digest: str, tokens: Sequence[int], salt: str | None = None) -> str:
    """The key of a prefix: sha256 chained over its blocks of KEY_BLOCK_TOKENS tokens (each link hashes the
    previous link, the block's length and its ids as little-endian int32), starting from the identity and the
    salt (`chain_start`)."""
    links = chain_links(identity_digest, tokens, salt)
    return links[-1][1] if links else chain_start(identity_digest, salt).hex()


def chain_links(identity_digest: str, tokens: Sequence[int], salt: str | None = None) -> list[tuple[int, str]]:
    """(length, key) after every block of the chain, in order: the keys of the prompt's prefixes that end at a
    multiple of KEY_BLOCK_TOKENS, and last the whole prompt's (its final block may be partial). The key of a
    prefix of b tokens is the same in every prompt that starts with those b tokens under the same salt."""
    link = chain_start(identity_digest, salt)
    out: list[tuple[int, str]] = []
    ids = memoryview(array("i", tokens)).cast("B")  # int32 (the platforms served are little-endian; checked at import)
    for start in range(0, len(tokens), KEY_BLOCK_TOKENS):
        stop = min(start + KEY_BLOCK_TOKENS, len(tokens))
        h = hashlib.sha256(link)
        h.update((stop - start).to_bytes(4, "little"))
        h.update(ids[4 * start : 4 * stop])
        link = h.digest()
        out.append((stop, link.hex()))
    return out
