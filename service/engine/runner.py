"""The model runner: owns the model's device tensors (the decode cache) and runs batched prefills and decode
steps for the engine's worker thread. Logits come back to the host once per call, as float32."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator, Sequence
from typing import Any

import psutil
import torch

from model.decoding import (
    DecodeCache,
    Decoder,
    DecodeState,
    prefill,
    prefill_steps,
    prefill_threads,
    sampling_threads,
    step_threads,
)
from model.decoding.cache_state import KeptPrefix
from model.decoding.extend import c_path as extend_in_c
from model.decoding.prefill import PromptScores, prefill_scored_steps
from model.decoding.prefill.scores import SCORE_ROWS, join_scores, score_logits
from model.decoding.steps.cuda_graphs import StepGraphs
from model.kernels.weights import WeightKind
from service.memory import HUGE_PAGE, container_memory_available, release_pages
from service.settings_prefix_cache import PREFIX_CACHE_SHARE

log = logging.getLogger("service.engine")

# Default decode-cache capacity when REFORMER_CACHE_BYTES is unset: this share of the free device memory
# after the model is loaded (CUDA), or of the available RAM within a container's memory limit (CPU); never
# more than max_batch_size requests of max_position_embeddings positions could use.
CUDA_CACHE_FRACTION = 0.5
CPU_CACHE_FRACTION = 0.25
# Tokens a causal prefill reads per slice (between two chances for the engine to run decode steps): about 35 ms
# of the shipped model's extend on two cores (bench/results/extend_cost_2026-12-07_25a38c4_quiet.json)
EXTEND_SLICE_TOKENS = 1024


def default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_CACHE_FRACTION)
    available = psutil.virtual_memory().available
    in_container = container_memory_available()  # /proc/meminfo shows the host's RAM, not a container's limit
    if in_container is not None:
        available = min(available, in_container)
    return int(available * CPU_CACHE_FRACTION)


def default_prefix_cache_bytes(decode_cache_bytes: int, device: torch.device) -> int:
    """The prefix cache's memory tier when REFORMER_PREFIX_CACHE_BYTES is unset: PREFIX_CACHE_SHARE of the
    decode cache's capacity; on a GPU, whose states are kept in host memory (service/prefix_cache/host.py), at
    most what `default_cache_bytes` gives a CPU decode cache of the host's available memory too."""
    share = int(decode_cache_bytes * PREFIX_CACHE_SHARE)
    if device.type == "cpu":
        return share
    return min(share, default_cache_bytes(torch.device("cpu")))


def step_graphs_for(device: torch.device, enabled: bool) -> StepGraphs | None:
    """The decode step's CUDA graphs when `enabled` (REFORMER_CUDA_GRAPHS) and the device is CUDA, else None."""
    return StepGraphs() if enabled and device.type == "cuda" else None


class ModelRunner:
    def __init__(self, model: Any, device: torch.device | None, max_slots: int, cache_bytes: int | None = None,
                 invariant: bool = False, max_tokens: int | None = None, cuda_graphs: bool = False,
                 cpu_kernel: bool = True, kv_dtype: torch.dtype | None = None,
                 decode_weights: WeightKind = "float32") -> None:
        """`max_tokens`: the longest prompt plus max_new_tokens the service admits (default: the model's
        positions); an automatic bucket count's LSH bucket counts are reserved for it (model/decoding/cache.py).
        `cuda_graphs`: on CUDA, decode steps replay captured graphs (`graphs`, model/decoding/steps/cuda_graphs.py;
        tests set
        their own). `cpu_kernel`: a float32 model's CPU cache attends through the C window kernel when it builds
        (model/kernels/bindings.py). `kv_dtype`: the cache's keys and values (None: the model's dtype).
        `decode_weights`: the C decode step's linear weights (REFORMER_DECODE_WEIGHTS)."""
        self.model = model
        self.device = device if device is not None else next(model.parameters()).device
        self.invariant = invariant
        probe = DecodeCache(model, 0, max_slots, max_tokens=max_tokens, cpu_kernel=False, kv_dtype=kv_dtype)
        # enough for every slot to hold a longest request; more could never be used
        most = probe.reserved_bytes_per_slot * (max_slots + 1) + max_slots * (
            -(-probe.max_tokens // probe.block_size) * probe.bytes_per_block)
        wanted = default_cache_bytes(self.device) if cache_bytes is None else cache_bytes
        self.cache = DecodeCache(model, min(wanted, most), max_slots, max_tokens=max_tokens, cpu_kernel=cpu_kernel,
                                 kv_dtype=kv_dtype)
        self.decoder = Decoder(model, self.cache, decode_weights)  # what computes the steps over the cache
        self.max_positions: int = model.config.max_position_embeddings
        self.graphs = step_graphs_for(self.device, cuda_graphs)
        self.last_rows_per_call = 0  # the most rows one model call of the last decode step held
        # the widest a run of free blocks must be to cover a whole huge page of the widest-rowed pool
        self._reach = max((-(-HUGE_PAGE // (self.cache.block_size * pool.stride(0) * pool.element_size()))
                           for pool in self.cache.block_pools), default=1)

    # ---- accounting --------------------------------------------------------------------------------------
    def fits_ever(self, tokens: int) -> bool:
        return self.cache.fits_ever(min(tokens, self.max_positions))

    def fits_together(self, token_counts: Sequence[int], spare_orders: int = 0) -> bool:
        """Whether requests of these sizes can all start now (on top of the running ones), forks among them
        holding `spare_orders` spare order blocks (model/decoding/cache.py `fork`) between them."""
        blocks = sum(-(-min(n, self.max_positions) // self.cache.block_size) for n in token_counts)
        return (blocks <= self.cache.free_blocks and len(token_counts) <= self.cache.free_slots
                and spare_orders <= self.cache.free_spare_orders)

    def limit_message(self, tokens: int) -> str:
        if min(tokens, self.max_positions) > self.cache.max_tokens:
            return (f"prompt plus max_new_tokens ({tokens} tokens) is more than the {self.cache.max_tokens} tokens "
                    "the decode cache was built for (max_input_tokens + max_new_tokens)")
        return (f"prompt plus max_new_tokens ({tokens} tokens) needs {self.cache.bytes_for(tokens)} bytes of decode "
                f"cache, more than its capacity of {self.cache.capacity_bytes} bytes (REFORMER_CACHE_BYTES)")

    # ---- model calls -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], reserve: Sequence[int]
                ) -> tuple[torch.Tensor, list[DecodeState]]:
        tensors = [torch.tensor(list(p), dtype=torch.long, device=self.device) for p in prompts]
        # small prefills on one intra-op thread (model.decoding.prefill_threads)
        with prefill_threads(max((len(p) for p in prompts), default=0) * len(prompts), self.device):
            logits, states = prefill(self.model, self.cache, tensors, [min(n, self.max_positions) for n in reserve])
        return logits.float().cpu(), states

    def prefill_slices(self, prompts: Sequence[Sequence[int]], reserve: Sequence[int]
                       ) -> Generator[None, None, tuple[torch.Tensor, list[DecodeState]]]:
        """`prefill` in slices (model.decoding.prefill_steps): each next() runs one slice; closing it frees the
        cache it holds."""
        with torch.inference_mode():
            tensors = [torch.tensor(list(p), dtype=torch.long, device=self.device) for p in prompts]
        steps = prefill_steps(self.model, self.cache, tensors, [min(n, self.max_positions) for n in reserve])
        while True:
            with torch.inference_mode():
                try:
                    next(steps)
                except StopIteration as done:
                    logits, states = done.value
                    return logits.float().cpu(), states
            try:
                yield
            except GeneratorExit:
                steps.close()
                raise

    def prefill_scored(self, prompts: Sequence[Sequence[int]], reserve: Sequence[int], score: Sequence[int | None]
                       ) -> tuple[torch.Tensor, list[DecodeState], list[PromptScores | None]]:
        """`prefill` that also scores the prompts `score` asks for (None or the alternatives k per prompt;
        model/decoding/prefill/scores.py): the logits, the states and each prompt's scores on the host."""
        with prefill_threads(max((len(p) for p in prompts), default=0) * len(prompts), self.device):
            steps = self.prefill_scored_slices(prompts, reserve, score)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]

    def prefill_scored_slices(self, prompts: Sequence[Sequence[int]], reserve: Sequence[int],
                              score: Sequence[int | None]
                              ) -> Generator[None, None, tuple[torch.Tensor, list[DecodeState],
                                                               list[PromptScores | None]]]:
        """`prefill_scored` in slices, as `prefill_slices`."""
        with torch.inference_mode():
            tensors = [torch.tensor(list(p), dtype=torch.long, device=self.device) for p in prompts]
        steps = prefill_scored_steps(self.model, self.cache, tensors, [min(n, self.max_positions) for n in reserve],
                                     score=score)
        while True:
            with torch.inference_mode():
                try:
                    next(steps)
                except StopIteration as done:
                    logits, states, scores = done.value
                    return logits.float().cpu(), states, scores
            try:
                yield
            except GeneratorExit:
                steps.close()
                raise

    def extend_slices(self, prompt: Sequence[int], reserve: int, state: DecodeState | None = None,
                      stops: Sequence[int] = (), slice_tokens: int = EXTEND_SLICE_TOKENS, score: int | None = None
                      ) -> Generator[tuple[int, torch.Tensor, DecodeState], None,
                                     tuple[torch.Tensor, DecodeState, PromptScores | None]]:
        """The causal prefill (REFORMER_PREFILL=causal): `prompt`'s tokens from `state.length` on read by the
        extend (model/decoding/extend.py), which leaves exactly what one decode step per token leaves, so each
        position's state is a function of the positions before it only. `state` None: a new state with room
        for `reserve` positions, read from position 0. Each next() reads at most `slice_tokens` tokens,
        stopping also at each length in `stops`, and yields (length, logits after that length's last token,
        state) so the caller can copy the state there; the generator returns (logits after the prompt's last
        token, state, scores). Closing it frees a state it made (a given one stays its owner's). A row's
        arithmetic never depends on the slice, the thread count or what else runs
        (tests/model/decoding/test_extend.py), so neither do the bits.

        `score` k (prompt logprobs; None: not scored, scores None): the prompt is read from position 0 (`state`
        None) with every token's logits (extend's `all_logits`, the bits of the decode step that reads it), in
        slices of at most SCORE_ROWS tokens; row t's scores the prompt token t+1 (model/decoding/prefill/scores.py
        `score_logits`, as the one-piece prefill's `score_prompts`), and the scores are the prompt's
        PromptScores."""
        ids = list(prompt)
        owned = state is None
        if score is not None and state is not None:
            raise ValueError("a scored causal prefill reads its prompt from position 0")
        if state is None:
            if not ids:
                raise ValueError("a causal prefill of an empty prompt")
            state = self.allocate(reserve)
        elif state.length >= len(ids):
            raise ValueError("a causal prefill from a state that already holds the whole prompt")
        if score is not None:
            slice_tokens = min(slice_tokens, SCORE_ROWS)  # a slice's logits (slice x vocab floats) exist at once
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        logits = torch.empty(0)
        try:
            marks = sorted(n for n in set(stops) if state.length < n <= len(ids))
            while state.length < len(ids):
                at = state.length
                end = min(len(ids), at + slice_tokens, *(n for n in marks if n > at))
                # the C extend gives the same bits on any thread count, and a slice of 1,024 rows keeps both
                # threads busy (prefill_threads would give a slice below 2,048 tokens one: a 65,536-byte prompt
                # then took 3.07 s through the service against 1.83 s one-piece, bench/results/
                # loadtest_prefix_causal_64k_c223109.json.gz); its step-per-token fallback (no kernels, GPU, automatic
                # bucket counts) stays on one thread, as a decode step of one row does
                threads = contextlib.nullcontext() if extend_in_c(self.decoder) else step_threads(1, self.device)
                with threads, torch.inference_mode():
                    out = self.decoder.extend(state, ids[at:end], all_logits=score is not None)
                    if score is not None:
                        scored = min(end, len(ids) - 1) - at  # the rows that predict a prompt token
                        if scored > 0:
                            parts.append(score_logits(out[:scored], torch.tensor(ids[at + 1 : at + 1 + scored]),
                                                      score))
                        out = out[-1].clone()  # not a view keeping the slice's rows
                logits = out if out.dtype == torch.float32 and out.device.type == "cpu" else out.float().cpu()
                yield state.length, logits, state
            return logits, state, join_scores(parts, score) if score is not None else None
        except BaseException:
            if owned:
                self.free(state)
            raise

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], states: Sequence[DecodeState]) -> torch.Tensor:
        # small steps on one intra-op thread (process-wide, restored after: model.decoding.step_threads). In
        # invariant mode, every step where one thread makes the CPU kernels compute each row alone
        # (Decoder.rows_independent: the per-layer path's products take the C kernel on one thread and
        # PyTorch's matmul on more, so a thread count that followed the batch size, on a host with more than
        # 2 cores, could give a row other bits batched; the one-call step gives the same bits on any count)
        with step_threads(1 if self.invariant and self.decoder.rows_independent(threads=1) else len(states),
                          self.device):
            # what the engine's batch_size metric observes, decided under the thread count the step runs with
            self.last_rows_per_call = self.decoder.rows_per_call(len(states), self.invariant)
            # host ints: the one-call CPU step reads them as they are, other paths copy them to the device once
            logits = self.decoder.step(list(tokens), states, self.invariant, self.graphs)
        return logits if logits.dtype == torch.float32 and logits.device.type == "cpu" else logits.float().cpu()

    def sampling_scope(self) -> contextlib.AbstractContextManager[None]:
        """Where the engine samples from a call's logits: one intra-op thread (model.decoding.sampling_threads)."""
        return sampling_threads(self.device)

    def allocate(self, tokens: int, shared: int = 0, kept: KeptPrefix | None = None) -> DecodeState:
        """A new request's state with room for `tokens` positions (a prefix-cache hit or a fork fills it); a
        fork's shares its first `shared` blocks with its leader (model/decoding/cache.py `fork`), a hit's with a
        live state or the kept prefix `kept`."""
        return self.cache.allocate(min(tokens, self.max_positions), shared, kept)

    def can_step(self, state: DecodeState) -> bool:
        return 0 <= state.slot and state.length < min(state.capacity * self.cache.block_size, self.max_positions)

    def free(self, state: DecodeState | None) -> None:
        if state is not None:
            self.cache.free(state)

    def release_free_pages(self, keep_bytes: int = 0) -> int:
        """Give the pages of the decode cache's free blocks back to the system (service/memory.py
        release_pages), those written since their last release, all but the lowest-numbered `keep_bytes` of
        blocks (handed out first, so short requests reuse resident pages instead of faulting them in); returns
        the bytes advised. The pools are mapped whole (model/decoding/huge_pages.py) and stay resident
        wherever they were ever written, so without this the cache's RSS is the high-water mark of every set
        of requests it held at once (a 64K-token prompt writes 260 MB of the shipped model's pools). Only whole
        huge pages inside free runs go back (model/decoding/cache.py `take_releasable`: a released row reads
        as zeros only where nothing reads it). The block pools only, the LSH layers' keys, values and key
        factors (most of a token's bytes): the LSH index's order is left as it is, and the local layers'
        rings belong to their slots (model/decoding/local_ring.py). The engine's worker calls it between
        turns (service/memory.py HeapKeeper): with `REFORMER_CACHE_KEEP_MB` after a request finished, with 0
        idle or over the budget."""
        cache = self.cache
        if self.device.type != "cpu":
            return 0
        runs = cache.take_releasable(-(-keep_bytes // max(cache.bytes_per_block, 1)), self._reach)
        released = 0
        for pool in cache.block_pools if runs else ():
            row = pool.stride(0) * pool.element_size()
            base = pool.untyped_storage().data_ptr()
            for start, stop in runs:
                released += release_pages(base + start * row, (stop - start) * row)
        return released

    def pool_storages(self) -> dict[int, int]:
        """{address: bytes} of the decode cache's pools (keys and values, norms, LSH orders): what
        reformer_decode_cache_resident_bytes reads the resident pages of (service/observability/memory_metrics.py)."""
        cache = self.cache
        tensors = [*cache.kv, *(n for n in cache.norms if n is not None),
                   *(ix.items for ix in cache.indexes if ix is not None)]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    def stats(self) -> dict[str, int]:
        return {"cache_bytes": self.cache.allocated_bytes, "cache_capacity_bytes": self.cache.capacity_bytes}
