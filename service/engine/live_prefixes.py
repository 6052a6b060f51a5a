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
are found freed (a freed `DecodeState` holds slot -1).

A state about to be freed (its request finished or left) leaves its prefix's blocks behind as a kept prefix
(`retire`, `DecodeCache.keep_prefix`), found by the same keys: the blocks are free, and a later request that
starts with the prefix shares them (`DecodeCache.allocate(..., kept=)`) for as long as none of them was handed
out again, so a second question about a document restores only what lies past them instead of copying the
whole document (vLLM keeps a freed block's contents the same way). Each time a state is retired, the kept
prefixes are cut to `limit()` blocks (the oldest used end first); they also end when their blocks are handed
out, or at `drop_kept`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from model.decoding.cache import DecodeCache
from model.decoding.cache_state import DecodeState, KeptPrefix

Holder = DecodeState | KeptPrefix


class LivePrefixes:
    def __init__(self, cache: DecodeCache, limit: Callable[[], int] | None = None) -> None:
        """`limit()`: the most blocks kept prefixes may hold (None: states are never kept once freed)."""
        self.cache = cache
        self.limit = limit
        # id -> (holder, the keys it is found by, its longest boundary)
        self._states: dict[int, tuple[Holder, list[str], int]] = {}
        self._by_key: dict[str, dict[int, Holder]] = {}
        self._kept: OrderedDict[int, KeptPrefix] = OrderedDict()  # by the allocator's id, least recently used first

    def __len__(self) -> int:
        return len(self._states)

    @property
    def kept_blocks(self) -> int:
        """Blocks the kept prefixes hold."""
        return sum(len(k.blocks) for k in self._kept.values())

    def add(self, state: DecodeState, links: Sequence[tuple[int, str]]) -> None:
        """`state` holds (or is reading) a causal prompt whose key chain is `links` ((length, key) after every
        block): found by each of those keys until it is freed. Adding it again changes nothing."""
        if id(state) in self._states or state.slot < 0:  # added again after each slice read: nothing to do
            return
        self._prune()
        self._register(state, [key for _, key in links], max((n for n, _ in links), default=0))

    def _register(self, holder: Holder, keys: list[str], longest: int) -> None:
        self._states[id(holder)] = (holder, keys, longest)
        for key in keys:
            self._by_key.setdefault(key, {})[id(holder)] = holder

    def retire(self, state: DecodeState) -> None:
        """`state` is about to be freed: when it holds a causal prompt, its blocks up to the prompt's longest
        boundary it has written past stay behind as a kept prefix, found by the same keys (unless a kept
        prefix with at least as many of those blocks is there already), within `limit()`."""
        entry = self._states.get(id(state))
        if self.limit is None or entry is None or state.slot < 0:
            return
        _, keys, longest = entry
        limit = self.limit()  # also the longest a restore can share: the longest state the prefix cache holds
        blocks = min(self.cache.shared_blocks(state.length), self.cache.shared_blocks(longest), limit)
        if blocks <= 0:
            self._trim(limit)  # the prefix cache may have let go of what the kept prefixes were for
            return
        carried = self.cache.kept_ids(state.blocks[:blocks])
        if any(len(self._kept[c].blocks) >= blocks for c in carried if c in self._kept):
            return  # a kept prefix holds these blocks and more: keeping these would end it
        kept = self.cache.keep_prefix(state, blocks)  # ends the prefixes that carried any of them
        for c in carried:
            self._forget(c)
        self._kept[kept.kept] = kept
        self._register(kept, keys, longest)
        self._trim(limit)

    def used(self, kept: KeptPrefix) -> None:
        """A request shares `kept`'s blocks: it is the last to end when prefixes go over the limit."""
        if kept.kept in self._kept:
            self._kept.move_to_end(kept.kept)

    def drop_kept(self) -> None:
        """Every kept prefix ends (the memory budget: their free blocks' pages can go back)."""
        self.cache.drop_kept(list(self._kept.values()))
        for kept in list(self._kept):
            self._forget(kept)

    def _trim(self, limit: int) -> None:
        while self._kept and self.kept_blocks > limit:
            oldest = next(iter(self._kept.values()))
            self.cache.drop_kept([oldest])
            self._forget(oldest.kept)

    def _forget(self, kept: int) -> None:
        prefix = self._kept.pop(kept, None)
        if prefix is not None:
            self._drop(prefix)

    def holder(self, links: Sequence[tuple[int, str]], upto: int) -> tuple[Holder, int] | None:
        """The live state or kept prefix that can share the most leading blocks with a state of a prompt with key
        chain `links` restored at `upto` positions (a boundary among them), and how many: at most
        `shared_blocks(upto)`, and only blocks it has written past. None when none can share a block."""
        best: tuple[Holder, int] | None = None
        for length, key in reversed(links):
            if length > upto:
                continue
            most = self.cache.shared_blocks(length)
            if most <= (best[1] if best is not None else 0):
                break  # shorter boundaries share fewer blocks still
            for state in list(self._by_key.get(key, {}).values()):
                if not self._alive(state):
                    self._drop(state)
                    continue
                k = min(most, self.cache.shared_blocks(state.length))
                if isinstance(state, KeptPrefix):
                    k = min(k, len(state.blocks))
                if k > (best[1] if best is not None else 0):
                    best = (state, k)
        return best

    def _alive(self, holder: Holder) -> bool:
        if isinstance(holder, KeptPrefix):
            if holder.kept in self._kept and self.cache.kept_valid(holder):
                return True
            self._kept.pop(holder.kept, None)  # a block of it was handed out: the allocator ended it
            return False
        return holder.slot >= 0

    def _prune(self) -> None:
        for holder, _, _ in [entry for entry in self._states.values() if not self._alive(entry[0])]:
            self._drop(holder)

    def _drop(self, state: Holder) -> None:
        _, keys, _ = self._states.pop(id(state), (state, [], 0))
        for key in keys:
            holders = self._by_key.get(key)
            if holders is not None:
                holders.pop(id(state), None)
                if not holders:
                    del self._by_key[key]
