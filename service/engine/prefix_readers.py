"""Causal prompts being read now, until their state is kept, and the prompts that wait for them instead of
reading the same tokens beside them.

Read causally, a prompt's state at a block boundary is a function of the tokens up to it, and the prefix cache
keeps it, with tails at earlier boundaries, once the read passes the boundary `PromptReuse.keep_at` picks
(service/engine/prompt_reuse.py). Two requests about one new document that arrive together would each read
the whole document: twice the work, each at about half the speed on shared cores. So a causal prompt that
shares a long prefix with a prompt being read now (the reader) waits, holding nothing, until the reader's
state is kept (`PromptReuse.keep`), then starts as any prompt does: it continues from the longest kept state
of its prefix, sharing the reader's blocks of it (service/engine/live_prefixes.py). Its answer is bit for bit
what it would be had it read everything itself: only where it starts changes.

It waits only when that is worth it: the boundary it would continue from (the longest one up to what it shares
with the reader that gets a tail, `tail_boundaries`) lies at least WAIT_MIN_GAIN tokens past the longest
state the cache holds for it now, and the reader has at most WAIT_REMAINING_FACTOR times that gain left to
read before its state is kept (reading the gain itself beside the reader, on the same cores, takes about
that long). A waiter whose reader fails or leaves starts at once and reads for itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.engine.jobs_runtime import GenerationJob

# the least a wait must save, in tokens: one causal slice's rows (service/engine/runner.py EXTEND_SLICE_TOKENS)
WAIT_MIN_GAIN = 1024
# a prompt waits while the reader has at most this many times the tokens it saves left to read
WAIT_REMAINING_FACTOR = 2


@dataclass
class Reader:
    job: GenerationJob
    keep: int  # the boundary its state is kept at
    tails: list[int]  # the boundaries up to `keep` it keeps a tail at (ascending, `keep` last)
    keys: list[str]  # the keys of its boundaries up to `keep`
    waiters: list[GenerationJob] = field(default_factory=list)

    def gain(self, shared: int, cached: int) -> int:
        """Tokens a prompt that shares this reader's first `shared` tokens, and finds a kept state of `cached`
        of them now, would not read by waiting: the reader's last tail at or before `shared`, past `cached`."""
        at = bisect.bisect_right(self.tails, shared)
        return self.tails[at - 1] - cached if at else 0

    @property
    def remaining(self) -> int:
        """Tokens the reader reads before its state is kept."""
        state = self.job.cache
        return self.keep - (state.length if state is not None else 0)


class PrefixReaders:
    """The readers by the key of every boundary up to their kept one, and their waiters. The worker's thread only."""

    def __init__(self) -> None:
        self._readers: dict[int, Reader] = {}  # id(job) -> its reader
        self._by_key: dict[str, list[Reader]] = {}
        # waiters whose reader's state was kept, or whose reader left: GenerationSteps starts them again
        self.released: list[GenerationJob] = []

    def __len__(self) -> int:
        """The prompts waiting, and those released and not yet handed back (`take_released`)."""
        return sum(len(r.waiters) for r in self._readers.values()) + len(self.released)

    def add(self, job: GenerationJob, keep: int, tails: Sequence[int], links: Sequence[tuple[int, str]]) -> None:
        """`job` reads its causal prompt (key chain `links`) from where it starts and keeps its state at `keep`,
        with tails at `tails`: a reader until `done`."""
        keys = [key for length, key in links if length <= keep]
        reader = Reader(job, keep, sorted(set(tails) | {keep}), keys)
        self._readers[id(job)] = reader
        for key in keys:
            self._by_key.setdefault(key, []).append(reader)

    def reader_for(self, links: Sequence[tuple[int, str]], cached: int) -> Reader | None:
        """The reader a prompt with key chain `links` (short of its end) that finds a kept state of `cached`
        tokens should wait for (see the module docstring), or None."""
        for length, key in reversed(links):
            if length - cached < WAIT_MIN_GAIN:
                return None  # shorter shared prefixes save less still
            for reader in self._by_key.get(key, ()):
                gain = reader.gain(length, cached)
                if gain >= WAIT_MIN_GAIN and reader.remaining <= WAIT_REMAINING_FACTOR * gain:
                    return reader
        return None

    def wait(self, reader: Reader, job: GenerationJob) -> None:
        reader.waiters.append(job)

    def done(self, job: GenerationJob) -> None:
        """`job` no longer reads (its state was kept, or it failed or left): its waiters are `released`."""
        reader = self._readers.pop(id(job), None)
        if reader is None:
            return
        for key in reader.keys:
            readers = self._by_key.get(key)
            if readers is not None:
                readers.remove(reader)
                if not readers:
                    del self._by_key[key]
        self.released.extend(reader.waiters)

    def take_released(self) -> list[GenerationJob]:
        released, self.released = self.released, []
        return released

    def drop_cancelled(self) -> list[GenerationJob]:
        """The waiters whose clients left, no longer waiting: the caller drops them."""
        gone = []
        for reader in self._readers.values():
            gone += [j for j in reader.waiters if j.cancel_requested]
            reader.waiters = [j for j in reader.waiters if not j.cancel_requested]
        return gone

    def take_all(self) -> list[GenerationJob]:
        """Every waiter (released ones too), forgotten with the readers (the engine fails them)."""
        jobs = [j for r in self._readers.values() for j in r.waiters] + self.take_released()
        self._readers.clear()
        self._by_key.clear()
        return jobs
