"""The live causal states of the decode cache, found by the key of every block boundary of their prompts: the
holders whose first blocks a prefix-cache hit shares instead of copying (service/engine/prompt_reuse.py
`_continue_causal`, model/decoding/cache.py `DecodeCache.share_prefix`).

Read causally (REFORMER_PREFILL=causal: decode steps, or the extend that leaves what they leave), a
position's keys, values and key factors are a function of the tokens up to it, so two prompts that start with
the same tokens hold the same bits there whoever read them: a kept state of a document restored for a second
question equals, in the document's blocks, what a request still reading or answering a first question holds.
The keys are the prefix cache's chain keys (service/prefix_cache/keys.py: the cache's identity, the salt and
every token up to the boundary), so a holder is never another salt's. Only prompts read causally are added
(`GenerationSteps._causal_slices`, as each slice is read; a scored prompt's too, whose bits are an unscored
read's; none under the one-piece prefill, whose keys depend on later tokens), and states restored from the
prefix cache and forks of a causal prompt once they hold their state.

A holder shares the blocks it has written past (`DecodeCache.shared_blocks` of its length): a successor-value
head writes a position's value slot when the next position is written. States leave the registry when they
are found freed (a freed `DecodeState` holds slot -1)."""

from __future__ import annotations

from collections.abc import Sequence

from model.decoding.cache import DecodeCache
from model.decoding.cache_state import DecodeState


class LivePrefixes:
    def __init__(self, cache: DecodeCache) -> None:
        self.cache = cache
        self._states: dict[int, tuple[DecodeState, list[str]]] = {}  # id -> (state, the keys it is found by)
        self._by_key: dict[str, dict[int, DecodeState]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add(self, state: DecodeState, links: Sequence[tuple[int, str]]) -> None:
        """`state` holds (or is reading) a causal prompt whose key chain is `links` ((length, key) after every
        block): found by each of those keys until it is freed. Adding it again changes nothing."""
        if id(state) in self._states or state.slot < 0:  # added again after each slice read: nothing to do
            return
        self._prune()
        keys = [key for _, key in links]
        self._states[id(state)] = (state, keys)
        for key in keys:
            self._by_key.setdefault(key, {})[id(state)] = state

    def holder(self, links: Sequence[tuple[int, str]], upto: int) -> tuple[DecodeState, int] | None:
        """The live state that can share the most leading blocks with a state of a prompt with key chain `links`
        restored at `upto` positions (a boundary among them), and how many: at most `shared_blocks(upto)`, and
        only blocks it has written past. None when none can share a block."""
        best: tuple[DecodeState, int] | None = None
        for length, key in reversed(links):
            if length > upto:
                continue
            most = self.cache.shared_blocks(length)
            if most <= (best[1] if best is not None else 0):
                break  # shorter boundaries share fewer blocks still
            for state in list(self._by_key.get(key, {}).values()):
                if state.slot < 0:
                    self._drop(state)
                    continue
                k = min(most, self.cache.shared_blocks(state.length))
                if k > (best[1] if best is not None else 0):
                    best = (state, k)
        return best

    def _prune(self) -> None:
        for state, _ in [entry for entry in self._states.values() if entry[0].slot < 0]:
            self._drop(state)

    def _drop(self, state: DecodeState) -> None:
        _, keys = self._states.pop(id(state), (state, []))
        for key in keys:
            holders = self._by_key.get(key)
            if holders is not None:
                holders.pop(id(state), None)
                if not holders:
                    del self._by_key[key]
