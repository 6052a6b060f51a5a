"""The memory tier's accounting under any sequence of puts, gets, pins and unpins: referenced + evictable + free
= capacity after every operation, least recently used unpinned entries go first, a pinned entry is never
evicted, and an entry that cannot fit is refused without evicting anything."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.decoding.snapshot import StateSnapshot
from service.prefix_cache.keys import KEY_BLOCK_TOKENS, CacheIdentity, chain_key
from service.prefix_cache.store import PrefixStore


def _snap(nbytes: int) -> StateSnapshot:
    return StateSnapshot(length=1, num_buckets=[], index_len=[], tensors={"logits": torch.zeros(nbytes // 4)})


def test_least_recently_used_goes_first_and_pinned_entries_stay() -> None:
    store = PrefixStore(300)
    assert store.put("a", _snap(100)) and store.put("b", _snap(100), pin=True) and store.put("c", _snap(100))
    store.get("a")  # a is now more recent than c
    assert store.put("d", _snap(100))  # evicts c: b is pinned, a was used after c
    assert "c" not in store and {"a", "b", "d"} <= {k for k in ("a", "b", "c", "d") if k in store}
    assert store.evictions == 1
    assert not store.put("e", _snap(400))  # larger than everything: refused, nothing evicted
    assert len(store) == 3
    store.check()


OPS = st.lists(st.tuples(st.sampled_from(["put", "put_pinned", "get", "unpin", "clear"]),
                         st.sampled_from("abcdef"), st.integers(1, 60)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(0, 200))
def test_the_accounting_holds_after_every_operation(ops: list[tuple[str, str, int]], capacity: int) -> None:
    store = PrefixStore(capacity * 4)
    pinned: dict[str, int] = {}
    for op, key, size in ops:
        if op in ("put", "put_pinned"):
            before = {k for k in "abcdef" if k in store}
            stored = store.put(key, _snap(size * 4), pin=op == "put_pinned")
            if stored and op == "put_pinned":
                pinned[key] = pinned.get(key, 0) + 1
            if not stored:
                assert {k for k in "abcdef" if k in store} == before  # a refusal evicts nothing
        elif op == "get":
            store.get(key)
        elif op == "unpin" and pinned.get(key):
            store.unpin(key)
            pinned[key] -= 1
        elif op == "clear":
            store.clear()
        assert all(k in store for k, n in pinned.items() if n)  # pinned entries are never evicted
        store.check()


def test_keys_chain_the_identity_and_every_token() -> None:
    identity = CacheIdentity("sha", 42, "float32", "float32", "cpu", 64, False)
    other = CacheIdentity("sha", 42, "float32", "bfloat16", "cpu", 64, False)
    tokens = list(range(3 * KEY_BLOCK_TOKENS + 5))
    key = chain_key(identity.digest(), tokens)
    assert key == chain_key(identity.digest(), list(tokens))
    assert key != chain_key(other.digest(), tokens)  # a bit-changing setting is part of the key
    assert key != chain_key(identity.digest(), tokens[:-1])
    assert key != chain_key(identity.digest(), [*tokens[:10], 7, *tokens[11:]])


def test_the_identity_covers_the_model_config() -> None:
    """Two configs with the same weights' sha256 (a chunk length changed, say) never share an entry."""
    from tests.model.helpers import tiny_config

    one, two = tiny_config(), tiny_config(lsh_attn_chunk_length=16)
    base = ("sha", 42, "float32", "float32", "cpu", 64, False)
    assert CacheIdentity(*base, config_digest=CacheIdentity.config_digest_of(one)).digest() != CacheIdentity(
        *base, config_digest=CacheIdentity.config_digest_of(two)).digest()
    assert CacheIdentity.config_digest_of(one) == CacheIdentity.config_digest_of(tiny_config())
