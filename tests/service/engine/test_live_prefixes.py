"""The registry of holders (service/engine/live_prefixes.py) on its own: a state about to be freed leaves a kept
prefix found by the same keys, within the limit (the least recently shared end first), never over a longer one
it would end, and none stays once the limit falls to nothing."""

from __future__ import annotations

from model.decoding import DecodeCache
from model.decoding.cache_state import DecodeState, KeptPrefix
from service.engine.live_prefixes import LivePrefixes
from tests.conftest import tiny_model


def _cache() -> DecodeCache:
    return DecodeCache.for_tokens(tiny_model(attn_layers=["local", "lsh"]), 400, slots=4, cpu_kernel=False)


def _state(cache: DecodeCache, length: int) -> DecodeState:
    state = cache.allocate(length + 8)
    state.length = length  # as if read: the registry only reads lengths and blocks
    return state


def _links(name: str, length: int) -> list[tuple[int, str]]:
    return [(n, f"{name}{n}") for n in range(64, length + 1, 64)]


def test_a_retired_state_is_kept_within_the_limit_and_found_by_its_keys() -> None:
    cache = _cache()
    limit = [1000]
    live = LivePrefixes(cache, lambda: limit[0])
    a, b = _state(cache, 200), _state(cache, 330)
    live.add(a, _links("a", 200))
    live.add(b, _links("b", 330))
    live.retire(a)
    cache.free(a)
    found = live.holder(_links("a", 200), 192)
    assert found is not None and isinstance(found[0], KeptPrefix) and found[1] == cache.shared_blocks(192)
    assert live.kept_blocks == cache.shared_blocks(192)  # up to its longest boundary it wrote past
    limit[0] = cache.shared_blocks(320)  # room for b's prefix only: a's, the older, ends
    live.retire(b)
    cache.free(b)
    assert live.holder(_links("a", 200), 192) is None
    assert live.kept_blocks == cache.shared_blocks(320)
    limit[0] = 0  # the prefix cache let go of everything: the next retirement ends the rest
    c = _state(cache, 100)
    live.add(c, _links("c", 100))
    live.retire(c)
    cache.free(c)
    assert live.kept_blocks == 0 and not cache.allocator.kept_by.any()
    cache.allocator.check()


def test_a_shorter_state_does_not_end_a_longer_kept_prefix_of_its_blocks() -> None:
    cache = _cache()
    live = LivePrefixes(cache, lambda: 1000)
    long = _state(cache, 320)
    live.add(long, _links("d", 320))
    live.retire(long)
    cache.free(long)
    (prefix,) = live._kept.values()
    shorter = cache.allocate(200, cache.shared_blocks(128), prefix)  # shares the prefix's first blocks
    shorter.length = 150
    live.add(shorter, _links("d", 150))
    live.retire(shorter)
    cache.free(shorter)
    assert list(live._kept.values()) == [prefix] and cache.kept_valid(prefix)
