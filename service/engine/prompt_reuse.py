"""Prompts read once: on the worker thread, before prefills run, each generation is sorted into one that
restores a cached state (a prefix-cache hit), one that shares the state of an identical prompt being prefilled
now (a fork: `n` / `best_of` choices, identical requests), or one that prefills (a leader, whose state is then
offered to the prefix cache and shared with the forks waiting on it).

A fork shares its leader's prompt blocks (model/decoding/cache.py `DecodeCache.fork`): it holds its own copy of
the block holding the prompt's last position, of the bucket orders and of the per-slot parts, and reads the
other blocks where the leader wrote them, so `n` choices hold the prompt once; admission reserves only a
fork's own part (`shared_blocks`). Its tokens are the leader's bits (the fork copies what a snapshot would).
Two identical prompts that both hit the prefix cache in one turn restore one copy: the second forks the first.

How a generation's prompt is processed never depends on what is cached (service/prefix_cache/__init__.py):
its segment (the whole prompt, or the part the request declared with `cache_prefix_chars`) is prefilled in one
forward, and the tokens after it are fed as decode steps (`GenerationJob.suffix`). A hit copies the state of
exactly that prefill (model/decoding/snapshot.py) and a fork shares it, so its tokens are the leader's bits. A prompt
that asks to be scored (prompt logprobs) always prefills, alone of the cache.

With the causal prefill (REFORMER_PREFILL=causal) the segment is always the whole prompt, read as decode steps
read tokens (service/engine/runner.py `extend_slices`), so the state after any block boundary of a prompt is
a function of the tokens before it: the prefix cache keeps the state at the prompt's last block boundary
while the prompt is read (`keep_at`, `keep_tail`, `keep`), and a later prompt continues from the longest
kept boundary it starts with (`PrefixCache.lookup_longest`): no request declares anything. A scored prompt is
read from position 0 (a kept state holds no scores of the positions before its boundary) and neither forks nor
is forked, but its state is offered at its last boundary like any causal prompt's: its bits are those of an
unscored read of the same tokens. The state a prompt continues from shares its first blocks with a live causal
state that holds the same prefix, when one does (service/engine/live_prefixes.py; `_continue_causal`): the
keys and values there are the same bits, so only the rest is copied, and admission reserves only that part
(`shared_blocks`). A scored prompt, read from position 0, never shares; its state is a holder like any."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from model.decoding.cache_state import CacheFull, DecodeState, KeptPrefix
from model.decoding.prefix_restore import BlockTails, restore_prefix
from model.decoding.snapshot import PREFIX_BLOCK, StateSnapshot, restore_snapshot, take_snapshot
from service.engine.jobs_runtime import GenerationJob
from service.engine.live_prefixes import LivePrefixes
from service.engine.prefix_readers import PrefixReaders
from service.prefix_cache.keys import KEY_BLOCK_TOKENS, chain_key

if TYPE_CHECKING:
    from service.engine.runner import ModelRunner
    from service.prefix_cache import PrefixCache
    from service.prefix_cache.metrics import PrefixCacheMetrics

log = logging.getLogger("service.engine")

assert KEY_BLOCK_TOKENS == PREFIX_BLOCK  # a key's blocks are the blocks a kept state can be cut back to

# The block boundaries a causal prompt keeps a tail at (BlockTails: what its kept state needs to be cut back to
# a boundary): every TAIL_SPACING tokens, and the last TAIL_NEAR_END boundaries up to the kept one. Each tail
# stops the extend there (it is the state at that boundary), and an extend of 256 tokens shares few windows:
# a 61,440-token prompt took 2.2-3.4 s read in 256-token calls against 1.6 s in 1,024-token ones (shipped model,
# two cores). A prompt that shares a prefix ending between two tails continues from the earlier one and reads
# the rest (at most TAIL_SPACING - 1 tokens more than its own); a second question or the next chat turn, whose
# shared prefix ends near the kept boundary, finds a tail there.
TAIL_SPACING = 4096
TAIL_NEAR_END = 4


def tail_boundaries(keep: int) -> list[int]:
    """The boundaries up to `keep` (a kept state's length) a causal prompt keeps a tail at."""
    near = keep - (TAIL_NEAR_END - 1) * KEY_BLOCK_TOKENS
    return [b for b in range(KEY_BLOCK_TOKENS, keep + 1, KEY_BLOCK_TOKENS) if b % TAIL_SPACING == 0 or b >= near]


# A prompt that continued from a kept state keeps its own only when it holds at least this many positions past
# it. A kept state is a copy of the whole state (about 2 KB a position on the shipped model, tails besides), so a
# short question after a long document, whose prompt crossed one more block boundary, copied all of it to keep
# 256 new positions: a 62,000-character document's later questions took 0.100 s against 0.025 s for those that
# did not (in-process server, scratch runs not kept), and each kept copy took about 200 MB of the memory tier.
# Such a question, asked again, continues from the document's state and reads its own tokens again.
KEEP_MIN_NEW_TOKENS = 1024

NO_IDENTITY = "00" * 32  # the chain's start when no prefix cache gives one (keys of prompts in flight only)


class Sorted(NamedTuple):
    prefill: list[GenerationJob]
    ready: list[tuple[GenerationJob, torch.Tensor]]
    failed: list[GenerationJob]
    # jobs that found too few free blocks (admission counted blocks they would share, and the sharing did not
    # happen): they hold nothing and wait until their blocks are free (GenerationSteps.blocked)
    blocked: list[GenerationJob]


class PromptReuse:
    def __init__(self, runner: ModelRunner, cache: PrefixCache | None, metrics: PrefixCacheMetrics | None,
                 report: bool = True, causal: bool = False, share_blocks: bool = True) -> None:
        self.runner = runner
        # forks share their leader's blocks (False: each restores a copy of its leader's snapshot)
        self.share_blocks = share_blocks
        self.causal = causal  # REFORMER_PREFILL=causal: prompts continue from kept block boundaries
        # whether a job's cached_tokens says what it reused (REFORMER_PREFIX_CACHE_REPORT); false: always 0
        self.report = report
        self.cache = cache
        self.metrics = metrics
        # the segment key of every leader being prefilled now -> the forks waiting for its state (their own
        # states allocated when they started, so the blocks admission counted for them are theirs)
        self.waiting: dict[str, list[GenerationJob]] = {}
        # the prefix-cache hits restored in the current `sort`, by key: an identical prompt after one forks it
        self._hits: dict[str, GenerationJob] = {}
        # the kept state whose cut-back orders are kept (StateSnapshot.cut): one at a time, so they add at most
        # one state's orders to what the prefix cache holds
        self._last_cut: weakref.ref[StateSnapshot] | None = None
        # the causal prompts' live states by the keys of their boundaries: a hit shares its first blocks with one
        # and, once they are freed, with the blocks they leave behind (kept prefixes), up to the longest state the
        # prefix cache holds in memory (what a restore could need at once)
        self.live = LivePrefixes(runner.cache, self._kept_limit) if causal and cache is not None and share_blocks \
            else None
        # causal prompts being read until their state is kept, and the prompts waiting for them (prefix_readers.py)
        self.readers = PrefixReaders() if causal and cache is not None else None

    def shared_blocks(self, jobs: list[GenerationJob]) -> list[int]:
        """For admission, per job in queue order: how many blocks it will share if they start together now: with
        its leader (`sort` makes it a fork: a prompt being prefilled or restored has its key), or, for a causal
        prompt the prefix cache holds a boundary of, with a live state of that prefix (`_continue_causal`: a
        running or prefilling request, or a job ahead of it here that restores one), else 0. A leader whose
        client leaves between admission and `sort`, or a kept state that expires meanwhile, makes the job need
        blocks admission did not count, which the cache may then lack (`_continue_causal` copies when they fit;
        else the job waits, holding nothing, until they are free: `Sorted.blocked`)."""
        out: list[int] = []
        seen: set[str] = set()
        planned = LivePrefixes(self.runner.cache)  # the jobs ahead that restore a kept state, at its length
        for job in jobs:
            if not self.share_blocks or job.spec.prompt_logprobs is not None:
                out.append(0)
                continue
            key = self._job_key(job)
            if key in seen or key in self.waiting:
                out.append(self.runner.cache.shared_blocks(len(job.prefill_ids)))
            else:
                out.append(self._will_share(job, planned))
            if not job.cancel_requested:  # one leaving now leads nothing (`prefill_all` drops it before `sort`)
                seen.add(key)
        return out

    def _kept_limit(self) -> int:
        """The most blocks kept prefixes hold: those of the longest state the prefix cache holds in memory."""
        assert self.cache is not None
        return -(-self.cache.store.longest() // self.runner.cache.block_size)

    def retire(self, state: DecodeState | None) -> None:
        """`state` is about to be freed: its prompt's blocks stay behind as a kept prefix (LivePrefixes.retire)."""
        if self.live is not None and state is not None:
            self.live.retire(state)

    @property
    def keeps_prefixes(self) -> bool:
        """Whether a finished causal request leaves its prompt's blocks behind for a later one (LivePrefixes)."""
        return self.live is not None and self.live.limit is not None

    def drop_kept(self) -> None:
        """Every kept prefix ends: their free blocks' pages can go back (the memory budget's trim)."""
        if self.live is not None:
            self.live.drop_kept()

    def _will_share(self, job: GenerationJob, planned: LivePrefixes) -> int:
        """Admission's guess of the blocks a causal prompt's `_continue_causal` shares with a live state (and,
        when it restores a kept state, that state among the `planned` holders of the jobs behind it)."""
        if self.live is None or self.cache is None:
            return 0
        short = self.short_links(job)
        length = self.cache.peek_longest(short, len(job.prefill_ids) - 1, job.read_ahead)
        if length is None:
            return 0
        found = [h for h in (self.live.holder(short, length), planned.holder(short, length)) if h is not None]
        if not job.cancel_requested:  # once restored, a holder for the jobs behind it
            planned.add(DecodeState(slot=0, blocks=[], length=length), self._links(job))
        # a kept prefix's blocks are free ones: sharing them takes them out of what admission counts
        return max((k for h, k in found if not isinstance(h, KeptPrefix)), default=0)

    def sort(self, jobs: list[GenerationJob]) -> Sorted:
        """The jobs that must prefill (leaders, and prompts that are scored), the hits with their logits (their
        states restored, ready to run), and the jobs that failed here (the caller fails them); forks wait in
        `waiting` for their leader."""
        out = Sorted([], [], [], [])
        self._hits = {}
        for job in jobs:
            try:
                self._sort_one(job, out)
            except CacheFull as exc:
                if job.cache is not None:
                    self.runner.free(job.cache)
                    job.cache = None
                if exc.never:
                    log.error("a prompt can never fit the decode cache: %s", exc, extra={"request_id": job.request_id})
                    out.failed.append(job)
                else:
                    log.info("too few free blocks for a prompt now (%s); it waits for them", exc,
                             extra={"request_id": job.request_id})
                    out.blocked.append(job)
            except Exception:
                log.exception("looking up or restoring a prompt's state failed", extra={"request_id": job.request_id})
                if job.cache is not None:
                    self.runner.free(job.cache)
                    job.cache = None
                out.failed.append(job)
        return out

    def _sort_one(self, job: GenerationJob, out: Sorted) -> None:
        if job.spec.prompt_logprobs is not None:
            out.prefill.append(job)
            return
        key = job.prefix_key = self._job_key(job)
        if key in self.waiting:
            self._own_state(job, fork=True)
            self.waiting[key].append(job)
            return
        hit = self._hits.get(key)
        if hit is not None and hit.cache is not None and self.share_blocks:  # restored just now: fork it
            self._own_state(job, fork=True)
            with torch.inference_mode():
                self.runner.cache.fork(hit.cache, job.cache)
            if self.metrics is not None:
                self.metrics.forks.inc()
            job.timings.cached_tokens = hit.timings.cached_tokens
            out.ready.append((job, next(logits for j, logits in out.ready if j is hit)))
            return
        if self.causal:
            if self._waits_for_reader(job):
                return
            self._continue_causal(job)
            if job.cache is None:  # read from position 0: its blocks taken now, so that one admission counted as
                # sharing waits for them here (`sort`: blocked), holding nothing, not midway through its read
                job.cache = self.runner.allocate(min(len(job.spec.prompt_ids) + job.spec.max_new_tokens,
                                                     self.runner.max_positions))
            self.waiting[key] = []
            out.prefill.append(job)
            keep = self.keep_at(job)
            if self.readers is not None and keep is not None:
                self.readers.add(job, keep, tail_boundaries(keep), self._links(job))
            return
        found = None
        if self.cache is not None:
            found = self.cache.lookup(key, len(job.prefill_ids), job.read_ahead)
            job.read_ahead = None  # the job holds no copy of a state it no longer needs
        if found is not None:
            snap, tier = found
            self._own_state(job)
            try:
                with torch.inference_mode():
                    restore_snapshot(self.runner.cache, snap, job.cache)
            except Exception:  # the entry is unusable: forget it (memory and disk), and compute what it held
                log.exception("restoring a kept state failed; prefilling instead", extra={"request_id": job.request_id})
                assert self.cache is not None
                self.cache.forget(key)
                self.runner.free(job.cache)
                job.cache = None
            else:
                self.cache.hit(tier, len(job.prefill_ids))  # type: ignore[union-attr]
                job.timings.cached_tokens = snap.length if self.report else 0
                out.ready.append((job, snap.logits))
                self._hits[key] = job
                return
        self.waiting[key] = []
        out.prefill.append(job)

    def _waits_for_reader(self, job: GenerationJob) -> bool:
        """Whether a causal prompt waits, holding nothing, for a prompt being read now that shares a long prefix
        with it (service/engine/prefix_readers.py): it starts again once that one's state is kept."""
        if self.readers is None or self.cache is None:
            return False
        short = self.short_links(job)
        cached = self.cache.peek_longest(short, len(job.prefill_ids) - 1, job.read_ahead)
        if cached is None and len(job.prefill_ids) - 1 < self.cache.config.min_tokens:
            return False  # too short to find a kept state whatever is kept
        reader = self.readers.reader_for(short, cached or 0)
        if reader is None:
            return False
        self.readers.wait(reader, job)
        if self.metrics is not None:
            self.metrics.read_waits.inc()
        return True

    def _continue_causal(self, job: GenerationJob) -> None:
        """A causal prompt starts from the longest kept state of its prefix (restored into `job.cache`, which
        the job owns, with room for the whole request), or from nothing (`job.cache` None); either way its
        causal prefill then reads the rest."""
        read_ahead, job.read_ahead = job.read_ahead, None
        if self.cache is None:
            return
        short = self.short_links(job)
        found = self.cache.lookup_longest(short, len(job.prefill_ids) - 1, read_ahead)
        if found is None:
            return
        length, snap, tier = found
        try:
            state = self._allocate_sharing(job, short, length)
        except CacheFull:
            job.read_ahead = read_ahead  # looked up again when the job's blocks are free
            raise
        try:
            with torch.inference_mode():
                if snap.length == length:
                    restore_snapshot(self.runner.cache, snap, state)
                else:  # a longer prompt's state, cut back to the boundary this prompt shares with it
                    restore_prefix(self.runner.cache, self.runner.model.config, snap, state, length)
                    last = self._last_cut() if self._last_cut is not None else None
                    if last is not None and last is not snap:
                        last.cut = None
                    self._last_cut = weakref.ref(snap)
        except Exception:  # the entry is unusable: forget it (memory and disk), and compute what it held
            log.exception("restoring a kept state failed; prefilling instead", extra={"request_id": job.request_id})
            at = dict(self._links(job))[length]
            self.cache.forget(self.cache.boundaries.pop(at, at))  # the entry itself, kept at a later boundary
            self.runner.free(state)
            return
        self.cache.hit(tier, length)
        if snap.length == length and snap.tails:  # e.g. read from disk after a restart, or from a replica: found
            upto = [(n, key) for n, key in self._links(job) if n <= length]  # by its boundaries from now on
            self.cache.register(upto[-1][1], snap, upto)
        job.cache = state
        job.tails = BlockTails.of_snapshot(snap, length)
        job.timings.cached_tokens = length if self.report else 0
        self.reading(job, state)

    def _allocate_sharing(self, job: GenerationJob, links: list[tuple[int, str]], length: int) -> DecodeState:
        """The state a causal prompt's kept state at `length` is restored into: its first blocks shared with the
        live state that holds the most of them (`LivePrefixes.holder`, `DecodeCache.share_prefix`), the rest its
        own; all its own where none holds any, or where the cache lacks the spare order blocks sharing needs and
        has the blocks copying needs."""
        cache = self.runner.cache
        tokens = min(len(job.spec.prompt_ids) + job.spec.max_new_tokens, self.runner.max_positions)
        found = self.live.holder(links, length) if self.live is not None else None
        kept = found[0] if found is not None and isinstance(found[0], KeptPrefix) else None
        if found is None or (not cache.fits_now(tokens, found[1], kept) and cache.fits_now(tokens)):
            return self.runner.allocate(tokens)
        holder, shared = found
        if isinstance(holder, KeptPrefix):
            state = self.runner.allocate(tokens, shared, holder)
            self.live.used(holder)  # type: ignore[union-attr]
        else:
            state = self.runner.allocate(tokens, shared)
            cache.share_prefix(holder, state)
        if self.metrics is not None:
            self.metrics.shared_blocks.inc(shared)
        return state

    def reading(self, job: GenerationJob, state: DecodeState) -> None:
        """A causal prompt's state, read or restored so far: a holder of its prefix until it is freed."""
        if self.live is not None:
            self.live.add(state, self._links(job))

    def read(self, job: GenerationJob) -> None:
        """A causal prompt has been read to its end: no longer a reader (it was one until its state was kept)."""
        if self.readers is not None:
            self.readers.done(job)

    def keep_at(self, job: GenerationJob) -> int | None:
        """Where a causal prompt's state is worth keeping: its last block boundary short of its end (so a
        repeat of the prompt has a token to read and logits of its own), when the prefix cache takes it and it
        lies past the state the prompt started from, by at least KEEP_MIN_NEW_TOKENS when it started from a kept
        one; else None. A scored prompt's too: its every row is the bits of an unscored read (its logits at every
        row are only read out as well)."""
        if self.cache is None:
            return None
        ends = [n for n, _ in self._links(job) if self.cache.config.min_tokens <= n < len(job.prefill_ids)]
        start = job.cache.length if job.cache is not None else 0
        if not ends or ends[-1] <= start or (start and ends[-1] - start < KEEP_MIN_NEW_TOKENS):
            return None
        length = ends[-1]
        return length if self.cache.wants(length, self.runner.cache.bytes_for(length)) else None

    def keep_tail(self, job: GenerationJob, state: object, logits: torch.Tensor) -> None:
        """A causal prompt passed a block boundary on its way to `keep_at`: what a truncation back to it needs."""
        if job.tails is None:
            job.tails = BlockTails()
        with torch.inference_mode():
            job.tails.keep(self.runner.cache, state, logits)  # type: ignore[arg-type]

    def keep(self, job: GenerationJob, state: object, logits: torch.Tensor, length: int) -> None:
        """Offer a causal prompt's state at `length` (a block boundary) to the prefix cache, found by the key
        of every boundary up to it (`PrefixCache.register`)."""
        assert self.cache is not None
        with torch.inference_mode():
            snap = take_snapshot(self.runner.cache, state, logits)  # type: ignore[arg-type]
        if job.tails is not None:
            job.tails.attach(snap)
            job.tails = None
        try:
            upto = [(n, key) for n, key in self._links(job) if n <= length]
            key = upto[-1][1]
            if self.cache.offer(key, snap):
                self.cache.register(key, snap, upto)
        except Exception:  # the cache is an optimisation: the request goes on without it
            log.exception("could not keep a state in the prefix cache", extra={"request_id": job.request_id})
        if self.readers is not None:
            self.readers.done(job)  # the prompts waiting for it start again: they continue from this state

    def short_links(self, job: GenerationJob) -> list[tuple[int, str]]:
        """The causal prompt's key chain short of its end: the boundaries it can continue from (its last token is
        always read, so a state of the whole prompt is never one)."""
        return [(n, key) for n, key in self._links(job) if n < len(job.prefill_ids)]

    def _links(self, job: GenerationJob) -> list[tuple[int, str]]:
        """The causal prompt's key chain, (length, key) after every block: hashed once per job (by the engine
        when it asked the disk tier ahead, else here)."""
        assert self.cache is not None
        if job.links is None:
            job.links = self.cache.links(job.prefill_ids, job.spec.cache_salt)
        return job.links

    def job_key(self, job: GenerationJob) -> str:
        """`_job_key`, for the engine to work out ahead, off its lock (service/engine/core.py `_key_queued`)."""
        return self._job_key(job)

    def _job_key(self, job: GenerationJob) -> str:
        """`_key`, worked out once per job (a causal prompt's key chain with it)."""
        if job.reuse_key is None:
            job.reuse_key = self._key(job)
        return job.reuse_key

    def _key(self, job: GenerationJob) -> str:
        salt = job.spec.cache_salt
        if self.cache is not None and self.causal and job.prefill_ids:
            return self._links(job)[-1][1]  # the whole prompt's key: the chain's last link
        if self.cache is not None:
            return self.cache.key(job.prefill_ids, salt)
        # no cache: forks still share one prefill, and a key need only tell apart the prompts in flight (and
        # their salts: a caller never shares another tenant's prefill, nor learns of it from cached_tokens)
        return chain_key(NO_IDENTITY, job.prefill_ids, salt)

    def _own_state(self, job: GenerationJob, fork: bool = False) -> None:
        """The job starts (its sampler) and gets its own state for its prompt plus max_new_tokens, for a kept
        state to be copied into, or, for a `fork`, a leader's state to be shared (`share`): its own blocks but
        for those it will share with the leader, when the cache has the spare order blocks they need (else
        blocks of its own for every position: `DecodeCache.fork` then copies them all)."""
        job.begin()
        tokens = min(len(job.spec.prompt_ids) + job.spec.max_new_tokens, self.runner.max_positions)
        cache = self.runner.cache
        shared = cache.shared_blocks(len(job.prefill_ids)) if fork and self.share_blocks else 0
        if shared and not cache.fits_now(tokens, shared) and cache.fits_now(tokens):
            shared = 0
        job.cache = self.runner.allocate(tokens, shared)

    def take_forks(self, job: GenerationJob) -> list[GenerationJob] | None:
        """A leader's prefill is done: the forks that waited on it (they run with its logits; `share` fills
        their states before the next decode step), or None when the job leads nothing (a scored prompt)."""
        if job.prefix_key is None:
            return None
        forks = self.waiting.pop(job.prefix_key, [])
        for fork in forks:
            fork.timings.cached_tokens = len(fork.prefill_ids) if self.report else 0
        if self.metrics is not None:
            self.metrics.forks.inc(len(forks))
        return forks

    def share(self, job: GenerationJob, state: object, logits: torch.Tensor, forks: list[GenerationJob]) -> None:
        """After the leader's and its forks' first tokens went out, before the next decode step: offer the
        leader's `state` (and the logits after its segment) to the prefix cache, and fork it into each fork
        still running (`DecodeCache.fork`; with `share_blocks` off, a copy of its snapshot)."""
        key = job.prefix_key
        assert key is not None
        length = len(job.prefill_ids)
        # a causal prompt's state was kept at its last block boundary while it was read (`keep`)
        keep = not self.causal and self.cache is not None and self.cache.wants(
            length, self.runner.cache.bytes_for(length))
        if not keep and not forks:
            return
        with torch.inference_mode():
            for fork in forks if self.share_blocks else []:
                self.runner.cache.fork(state, fork.cache)  # type: ignore[arg-type]
                self.reading(fork, fork.cache)  # type: ignore[arg-type]
            if not keep and self.share_blocks:
                return
            # one copy out of the cache serves the prefix cache (and, with share_blocks off, every fork)
            snap = take_snapshot(self.runner.cache, state, logits)  # type: ignore[arg-type]
            for fork in forks if not self.share_blocks else []:
                restore_snapshot(self.runner.cache, snap, fork.cache)
        if keep:
            assert self.cache is not None
            try:
                self.cache.offer(key, snap)
            except Exception:  # the cache is an optimisation: the request goes on without it
                log.exception("could not keep a prefilled state in the prefix cache",
                              extra={"request_id": job.request_id})

    def orphans(self, leader: GenerationJob) -> list[GenerationJob]:
        """The forks of a leader that will not finish (it failed or was dropped): the caller fails them. The
        prompts waiting for it as a reader (prefix_readers.py) are released instead: they read for themselves."""
        if self.readers is not None:
            self.readers.done(leader)
        key = leader.prefix_key
        return self.waiting.pop(key, []) if key is not None else []

    def take_all(self) -> list[GenerationJob]:
        jobs = [job for forks in self.waiting.values() for job in forks]
        self.waiting.clear()
        return jobs + (self.readers.take_all() if self.readers is not None else [])
