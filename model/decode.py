"""Incremental decoding: batched prefill and one batched decode step for every running request.

Prefill runs prompts through the full forward and stores, per layer, the keys and values of every position
in the request's blocks of a `DecodeCache` (LSH: the shared query/key projection) and, per LSH head and
hash round, the bucket bookkeeping of `LSHIndex`. A decode step computes the new position of all B rows at
once: embeddings, layer norms, projections, feed-forward and LM head as (B, hidden) matmuls; the attention
windows of all rows, heads and hash rounds gathered together with padded widths and masks:

- local layers attend over the cached keys of the new position's chunk window;
- LSH layers hash the new query with the model's rotations, find in every round the slot it takes in the
  bucket-sorted order of all positions, and attend to exactly the keys a full forward's last position sees
  there: its chunk and the chunks before it in the row's own padded layout, wrapping into the previous
  round as the full forward does; rounds are combined by their log-sum-exp weights.

The new position's result equals the full forward's last position whenever the cached keys equal the full
forward's (local-only models; LSH layers whose inputs come from local layers only). Deeper LSH stacks keep
earlier positions' states as they were computed, which is what makes the cost per token independent of
the prompt length (tests/model/test_decode.py and bench/decode_quality.py measure the difference).

Shapes: a step's rows are padded to a batch bucket (1, 2, 4, ... 64, then multiples of 64), padding rows
reading and writing the cache's scratch slot. With `invariant=True` rows run in fixed blocks of
`INVARIANT_ROWS`, so a row's logits are bit-identical whatever it is batched with (F.linear gives a row the
same bits whenever the number of rows is the same). A CPU step whose attention and products all run through
the C kernels (`DecodeCache.rows_independent`) computes every row alone already: it needs no fixed blocks
(`rows_per_call`), and gives a row the bits of its step alone in either mode (tests/model/test_decode.py).

On such a CPU cache a step's layers run in one C call (model/step_fused.py: the same C functions as the
per-layer path below, with the same bits) over exactly the batch's rows, no padding rows and no blocks,
its inputs passed as host ints; the per-layer path runs where that call does not apply (other dtypes,
GPUs, a model whose activation or layer norms the C side does not compute).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import rehash_ahead
from .attention import AttentionContext, LocalSelfAttention, LSHSelfAttention
from .batch import prepare_batch
from .chunking import mask_value, round_weights, self_mask_value
from .decode_cache import CacheFull, DecodeCache, DecodeState, _flat
from .decode_index import BlockLookup, LSHIndex, WindowGeometry
from .feedforward import EVAL_CHUNK
from .prefill_slices import DEFAULT_SLICE_CHUNKS, at_positions, layer_f_slices, projections
from .step_graphs import StepGraphs

if TYPE_CHECKING:
    from .config import ReformerConfig
    from .reformer import ReformerLM
    from .reversible import ReformerLayer

__all__ = ["CacheFull", "DecodeCache", "DecodeState", "INVARIANT_ROWS", "SINGLE_THREAD_PREFILL_TOKENS",
           "SINGLE_THREAD_ROWS", "batch_bucket", "decode_step", "prefill", "prefill_steps", "prefill_threads",
           "rows_per_call", "sampling_threads", "step_threads"]

INVARIANT_ROWS = 16
# A step over at most this many rows is hundreds of tiny ops: a second intra-op thread only adds a hand-off
# per op (CPU time twice the wall time), so it runs on one thread. A larger step leaves one core to the rest
# of the process: in the service the event loop that delivers the step's tokens runs beside it, and intra-op
# threads that must wait for a busy core at every op barrier lose more than they gain. Measured with the
# engine and the shipped model, 2 cores, 128-token generations of 256-token prompts (a hand measurement):
# 8 streams, model step 7.5 ms on 2 threads against 3.6 ms on 1; 32 streams, 12.1 against 9.5 ms.
SINGLE_THREAD_ROWS = 4


@contextmanager
def _intra_op_threads(want: int, device: torch.device | None) -> Iterator[None]:
    """Run the block on `want` intra-op threads and restore the count after; a non-CPU device is left alone
    (intra-op threads are a CPU matter). torch.set_num_threads is process-wide: only the model's callers (the
    service's model runner, bench/generate.py) use this, from the one thread that runs model calls."""
    before = torch.get_num_threads()
    if want == before or (device is not None and device.type != "cpu"):
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_threads(rows: int, device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for a CPU step of at most SINGLE_THREAD_ROWS rows, all but one of the threads for
    a larger one, restored after (`_intra_op_threads`)."""
    before = torch.get_num_threads()
    return _intra_op_threads(1 if rows <= SINGLE_THREAD_ROWS else max(before - 1, 1), device)


# A prefill of at most this many padded tokens (prompts times the longest) runs on one intra-op thread: its ops
# are small enough that a second thread, whose core the service's event loop and clients also use, costs more
# than it gives. Measured with `reformer serve` and the shipped model on 2 cores (`reformer loadtest`,
# 256-byte prompts, 128 new tokens): /generate_stream TTFT p50 at concurrency 1 35-39 ms without the rule,
# 26-31 ms with it (three runs each, bench/results/loadtest_prefill_threads/ and bench/README.md); tokens/s
# at concurrency 1 and 8 within the spread between runs of either code.
SINGLE_THREAD_PREFILL_TOKENS = 2048
# An LSH index is built with one sort of all heads when they hold at most this many (head, position) pairs
# (a piece of 1.5 ms at 16K pairs, shipped model, one thread, timed by hand), one sort per head past it. Per head, the
# builds were 7% of a 256-token prompt's prefill; all heads at once took them from 1.05 to 0.77 ms for one
# such prompt and from 7.4 to 3.7 ms for eight prefilled together (scratch timing, load not recorded).
INDEX_BUILD_ITEMS = 16384

# A prefill writes its keys and values into the cache this many positions at a time, yielding between: the
# first prompt to reach fresh pool pages faults them in as it writes (a 60K prompt's write of one layer took
# 160-180 ms in one piece, 30-50 ms once the pages were there: a scratch slice-by-slice timing of the prefill,
# shipped model, one thread, load not recorded)
WRITE_ROWS = 8192


def prefill_threads(tokens: int, device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for a CPU prefill of at most SINGLE_THREAD_PREFILL_TOKENS padded tokens, the
    threads as they are for a larger one, restored after (`_intra_op_threads`)."""
    before = torch.get_num_threads()
    return _intra_op_threads(1 if tokens <= SINGLE_THREAD_PREFILL_TOKENS else before, device)


def sampling_threads(device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for the small tensor ops between model calls (a step's greedy choices, a row's
    sampling), restored after (`_intra_op_threads`). On more threads each op of a few microseconds is an
    OpenMP region whose hand-off to a thread parked during the step, on a core the service's event loop and
    clients keep busy, costs far more than the op. Measured in-process on 2 cores with the other core kept busy
    by a spinning process, shipped model, 8 rows: a step plus its greedy choice 2.9-6.2 ms with the choice on
    two threads, 1.7-2.8 ms on one (no difference with the other core idle)."""
    return _intra_op_threads(1, device)


def rows_per_call(cache: DecodeCache, rows: int, invariant: bool) -> int:
    """The most rows one model call of a step over `rows` rows holds: INVARIANT_ROWS in invariant mode
    unless the cache's steps compute each row alone now (`DecodeCache.rows_independent`), else all of them."""
    return INVARIANT_ROWS if _in_blocks(cache, invariant) else rows


def _in_blocks(cache: DecodeCache, invariant: bool) -> bool:
    """Fixed blocks of INVARIANT_ROWS only where a row's bits would otherwise depend on the batch."""
    return invariant and not cache.rows_independent()


def batch_bucket(rows: int) -> int:
    """The padded row count of a step: a power of two up to 64, then a multiple of 64."""
    if rows <= 64:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 64) * 64


def _layers(lm: ReformerLM) -> list[ReformerLayer]:
    return list(lm.layers)  # type: ignore[arg-type]


def _index_buckets(att: LSHSelfAttention, padded: int) -> int | list[int] | None:
    """The bucket count a row of this padded length hashes with, or None while it attends densely and the
    model has no fixed count (its index is built when it first hashes)."""
    if att.config.num_buckets is not None:
        return att.config.num_buckets
    return att.num_buckets_for(padded) if padded > att.chunk else None


@torch.no_grad()
def prefill(lm: ReformerLM, cache: DecodeCache, prompts: Sequence[Tensor], reserve: Sequence[int] | None = None
            ) -> tuple[Tensor, list[DecodeState]]:
    """Run the prompts (each (L_i,)) together; returns the logits after each prompt (N, vocab) and their
    states, holding blocks for `reserve[i]` positions (default: the prompt). Raises CacheFull (and
    allocates nothing) when they do not fit."""
    steps = prefill_steps(lm, cache, prompts, reserve)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def prefill_steps(lm: ReformerLM, cache: DecodeCache, prompts: Sequence[Tensor], reserve: Sequence[int] | None = None,
                  slice_chunks: int = DEFAULT_SLICE_CHUNKS) -> Generator[None, None, tuple[Tensor, list[DecodeState]]]:
    """`prefill` in slices: it yields after the embeddings, each projection and cache write, each LSH index build,
    each `slice_chunks` chunk-window attentions (model/prefill_slices.py) and each feed-forward slice, so a
    caller can run decode steps in between (chunked prefill). Hashing and sorting still see the whole prompt;
    the result is the same bits. Closing it early frees what it allocated."""
    lengths = [int(p.shape[0]) for p in prompts]
    if min(lengths, default=1) < 1:
        raise ValueError("prefill needs non-empty prompts")
    want = list(reserve) if reserve is not None else lengths
    states: list[DecodeState] = []
    try:
        for n, w in zip(lengths, want, strict=True):
            states.append(cache.allocate(max(n, w)))
        with torch.no_grad():
            result = yield from _prefill_layers(lm, cache, prompts, lengths, states, slice_chunks)
            lsh = [(li, att) for li, layer in enumerate(_layers(lm))
                   if isinstance(att := layer.attention.self_attention, LSHSelfAttention)]
            for state in states:  # close to a bucket-count change: hashed ahead now (model/rehash_ahead.py)
                coming = _coming_count(lm, cache, state, lsh)
                while coming is not None and rehash_ahead.advance(cache, state, lsh, coming):
                    yield
    except BaseException:
        for s in states:
            cache.free(s)
        raise
    return result


def _prefill_layers(lm: ReformerLM, cache: DecodeCache, prompts: Sequence[Tensor], lengths: list[int],
                    states: list[DecodeState], slice_chunks: int = DEFAULT_SLICE_CHUNKS
                    ) -> Generator[None, None, tuple[Tensor, list[DecodeState]]]:
    longest = max(lengths)
    ids = torch.full((len(prompts), longest), lm.config.pad_token_id, dtype=torch.long, device=cache.device)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long, device=cache.device)
    for i, p in enumerate(prompts):
        ids[i, : lengths[i]] = p.to(cache.device)
        mask[i, : lengths[i]] = 1
    batch = prepare_batch(ids, None if min(lengths) == longest else mask, lm.config)  # right-padded: no shift
    ctx = batch.context
    x1 = x2 = lm.embeddings(batch.input_ids)
    yield
    pos = torch.arange(longest, device=cache.device)
    slots = torch.tensor([s.slot for s in states], device=cache.device)
    rows = cache.rows(slots, pos.expand(len(prompts), longest))  # (N, L)
    real = mask.bool()
    last = torch.tensor(lengths, device=cache.device) - 1
    layers = _layers(lm)
    for li, layer in enumerate(layers):
        att = layer.attention.self_attention
        assert isinstance(att, LSHSelfAttention | LocalSelfAttention)
        # the attention's projections (and an LSH layer's hashing) of the padded batch, computed once: the
        # cache keeps what the attention below attends with (a 64K prompt's projections and hash are ~0.6 s
        # a layer on this project's CPU)
        given = yield from projections(att, layer.attention.layer_norm(x2), ctx)
        keys, values = given.key[:, :, :longest], given.value[:, :, :longest]  # (N, H, L, D)
        # padding positions of the shorter prompts are written to the scratch block, never read
        at = torch.where(real, rows, 0).reshape(-1)
        flat_keys = keys.transpose(1, 2).reshape(-1, att.heads, att.head_size)  # (N*L, H, D)
        flat_values = values.transpose(1, 2).reshape(-1, att.heads, att.head_size)
        for p0 in range(0, at.shape[0], WRITE_ROWS):
            p1 = p0 + WRITE_ROWS
            cache.write(li, at[p0:p1], flat_keys[p0:p1], flat_values[p0:p1])
            yield
        if isinstance(att, LSHSelfAttention):
            for i, state in enumerate(states):
                nb = _index_buckets(att, lm.config.padded_length(lengths[i]))
                if nb is not None:
                    hashed = _row_buckets(att, given.buckets, ctx, i, nb)
                    yield from _build_index_steps(cache, li, att, state, keys[i, :, : lengths[i]], nb,
                                                  None if hashed is None else hashed[:, :, : lengths[i]])
        # the layer as ReformerLayer.forward computes it (eval, no dropout), its attention in slices of chunks.
        # The last layer's outputs feed only the logits after each prompt: its output projection and
        # feed-forward run on those positions alone (its keys and values, above, cover every position)
        if li == len(layers) - 1:
            x1 = at_positions(x1, last) + (yield from layer_f_slices(layer, x2, ctx, slice_chunks, given, last))
            x2 = at_positions(x2, last) + layer.feed_forward(x1)  # (N, 1, hidden)
            break
        f_out = yield from layer_f_slices(layer, x2, ctx, slice_chunks, given)
        x1 = x1 + f_out
        yield
        ff = layer.feed_forward
        size = ff.chunk or EVAL_CHUNK
        if x1.shape[1] <= size:
            x2 = x2 + ff(x1)
        else:
            # the slices the chunked feed-forward runs anyway, each added into its part of the new x2 (no
            # whole-prompt concatenation and sum in one piece)
            summed = torch.empty_like(x2)
            for a in range(0, x1.shape[1], size):
                torch.add(x2[:, a : a + size], ff(x1[:, a : a + size]), out=summed[:, a : a + size])
                yield
            x2 = summed
    hidden = torch.cat([x1, x2], dim=-1)[:, 0]  # (N, 2*hidden): after each prompt's last position
    for state, n in zip(states, lengths):
        state.length = n
    return lm.lm_head(lm.final_layer_norm(hidden)), states


def _row_buckets(att: LSHSelfAttention, buckets: Tensor | None, ctx: AttentionContext, row: int,
                 nb: int | list[int]) -> Tensor | None:
    """Row `row`'s buckets (H, R, L) from the prefill attention's hash of the batch, when that hash used the
    count `nb` the row's index is built with (attention._hash_rows: the fixed count, or the row's own), else
    None."""
    if buckets is None:
        return None
    fixed = att.config.num_buckets
    used = fixed if fixed is not None else att.num_buckets_for(int(ctx.own_length[row]))
    return buckets[row] if str(used) == str(nb) else None


def _build_index_steps(cache: DecodeCache, layer: int, att: LSHSelfAttention, state: DecodeState,
                       keys: Tensor | None, nb: int | list[int], buckets: Tensor | None = None
                       ) -> Generator[None, None, None]:
    """(Re)build a request's LSH index of one layer from its keys (H, L, D): one full hash (or its `buckets`
    (H, R, L) already hashed with `nb`; then `keys` may be None), then one sort of every head at once for a
    prompt of at most INDEX_BUILD_ITEMS (head, position) pairs, else one per head, yielding after each (a
    60K-token prompt's sort of every head at once is a ~200 ms piece)."""
    index = cache.indexes[layer]
    assert index is not None
    index.grow_buckets(_flat(nb))
    if buckets is None:
        assert keys is not None
        buckets = att.hash(keys.unsqueeze(0), nb, None)[0]  # (H, R, L)
    length = buckets.shape[-1]
    rows = _slot_rows(cache, state, length)
    yield
    heads = buckets.shape[0]
    group = heads if heads * length <= INDEX_BUILD_ITEMS else 1
    for h in range(0, heads, group):
        index.build(state.slot, rows, buckets[h : h + group], heads=slice(h, h + group), kernel=cache.window_kernel)
        yield
    state.num_buckets[layer] = nb
    state.index_len[layer] = length


def _build_index(cache: DecodeCache, layer: int, att: LSHSelfAttention, state: DecodeState,
                 keys: Tensor | None, nb: int | list[int], buckets: Tensor | None = None) -> None:
    """`_build_index_steps` in one go."""
    for _ in _build_index_steps(cache, layer, att, state, keys, nb, buckets):
        pass


def _slot_rows(cache: DecodeCache, state: DecodeState, length: int) -> Tensor:
    """Pool rows (length,) of a request's positions 0..length-1."""
    return cache.slot_rows(state, 0, length)


def _maintain_indexes(lm: ReformerLM, cache: DecodeCache, states: Sequence[DecodeState]) -> None:
    """Before a step, per row (host-known, rare): an automatic bucket count that changes with the length (or
    a row that starts hashing) rebuilds that row's index from its cached keys, O(L) once; a recent order that
    is full is merged into the main order (model/decode_index.py), O(L) every RECENT steps. Every LSH layer
    shares the bucket-count rule, so the count is worked out once per row, not once per row and layer."""
    lsh = [(li, att) for li, p in enumerate(_plan(lm)) if isinstance(att := p.attention, LSHSelfAttention)]
    if not lsh:
        return
    for state in states:
        nb = _index_buckets(lsh[0][1], lm.config.padded_length(state.length + 1))
        rows: Tensor | None = None  # the row's pool rows, looked up once for all its layers
        rebuilt = False
        for li, att in lsh:
            index = cache.indexes[li]
            assert index is not None
            rebuild = att.config.num_buckets is None and nb is not None and nb != state.num_buckets[li]
            merge = state.num_buckets[li] is not None and state.length - state.index_len[li] >= index.recent_size
            if not (rebuild or merge):
                continue
            rows = _slot_rows(cache, state, state.length) if rows is None else rows
            if rebuild:
                assert nb is not None
                rebuilt = True
                hashed = rehash_ahead.take(cache, state, li, att, nb, rows)
                keys = None if hashed is not None else cache.keys[li].index_select(0, rows).transpose(0, 1)
                _build_index(cache, li, att, state, keys, nb, hashed)  # keys (H, L, D) or buckets (H, R, L)
            else:
                index.merge(state.slot, rows, state.index_len[li], state.length - state.index_len[li],
                            cache.window_kernel)
                state.index_len[li] = state.length
        if rebuilt:
            state.rehash = None
        coming = _coming_count(lm, cache, state, lsh)
        if coming is not None:  # a count change near: one slice of its hashing now, not all of it in one step
            rehash_ahead.advance(cache, state, lsh, coming)


def _coming_count(lm: ReformerLM, cache: DecodeCache, state: DecodeState,
                  lsh: Sequence[tuple[int, LSHSelfAttention]]) -> int | list[int] | None:
    """The automatic bucket count the request changes to within rehash_ahead's lead, else None."""
    if not lsh or lsh[0][1].config.num_buckets is not None:
        return None
    last = min(state.capacity * cache.block_size, lm.config.max_position_embeddings) - 1  # the last it may write
    return _next_count(lsh[0][1], lm.config, state.length,
                       min(rehash_ahead.lead(len(lsh), state.length), last - state.length))


def _next_count(att: LSHSelfAttention, cfg: ReformerConfig, length: int, within: int) -> int | list[int] | None:
    """The automatic bucket count a request of `length` positions changes to first in its next `within` steps,
    or None (a binary search: the count only grows with the length)."""
    def count(n: int) -> str:  # the count of the step that writes position n
        return str(_index_buckets(att, cfg.padded_length(n + 1)))

    now = count(length)
    lo, hi = length, length + within
    if within < 1 or count(hi) == now:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) == now else (lo, mid)
    return _index_buckets(att, cfg.padded_length(hi + 1))


@torch.no_grad()
def decode_step(lm: ReformerLM, tokens: Tensor | Sequence[int], cache: DecodeCache, states: Sequence[DecodeState],
                invariant: bool = False, graphs: StepGraphs | None = None) -> Tensor:
    """Append tokens (B,) to the B requests; returns the logits (B, vocab) for the position after each. `tokens`
    may be host ints (the service's sampled tokens) or a tensor. With `graphs` (CUDA), steps it can capture
    replay CUDA graphs, with the same results (model/step_graphs.py)."""
    b = len(states)
    # host ints where the step can use them (a CPU tensor's values are on the host already; a device tensor's
    # stay there: reading them would be a sync)
    host = [int(t) for t in tokens] if not isinstance(tokens, Tensor) else (
        tokens.reshape(-1).tolist() if tokens.device.type == "cpu" else None)
    n = len(host) if host is not None else int(tokens.numel())  # type: ignore[union-attr]
    if n != b:
        raise ValueError(f"{n} tokens for {b} decoding states")
    for state in states:
        if state.slot < 0:
            raise ValueError("decoding a request whose cache was freed")
        if state.length >= lm.config.max_position_embeddings:
            raise ValueError(f"decoding past max_position_embeddings {lm.config.max_position_embeddings}")
        if state.length >= state.capacity * cache.block_size:
            raise ValueError(f"decoding past the {state.capacity * cache.block_size} positions reserved")
    _maintain_indexes(lm, cache, states)
    if graphs is None and cache.fused_step is not None and host is not None:
        # the one-call step computes each row alone (same bits in any batch): exactly the batch's rows, no
        # padding to a batch bucket and no blocks, from host inputs (model/step_fused.py)
        rows_meta, nbs = _row_facts(lm, cache, states)
        logits = cache.fused_step.run(lm, cache, host, rows_meta, _bucket_groups(nbs))
        if logits is not None:
            for state in states:
                state.length += 1
            return logits
    if host is not None:
        tokens = torch.tensor(host, dtype=torch.long, device=cache.device)
    assert isinstance(tokens, Tensor)
    tokens = tokens.reshape(-1).to(cache.device)
    size = INVARIANT_ROWS if _in_blocks(cache, invariant) else batch_bucket(b)
    out = []
    for start in range(0, b, size):
        part = list(states[start : start + size])
        out.append(_step_rows(lm, cache, tokens[start : start + size], part, size, graphs)[: len(part)])
    for state in states:
        state.length += 1
    return torch.cat(out) if len(out) > 1 else out[0]


def _first_lsh(cfg: ReformerConfig) -> int | None:
    """The first LSH layer's index (its attention sets the window geometry every LSH layer shares), or None."""
    return next((i for i, k in enumerate(cfg.attn_layers) if k == "lsh"), None)


def _row_facts(lm: ReformerLM, cache: DecodeCache, states: Sequence[DecodeState]
               ) -> tuple[list[list[int]], list[int | list[int] | None]]:
    """Each row's host-known facts (every LSH layer shares its chunk and bucket-count rule, every local layer its
    chunk): slot, position, LSH hashed, LSH chunks, local dense, the slot whose LSH index the row appends to
    (the scratch slot when it keeps none) and whether it keeps one; and each row's bucket count (None: none)."""
    cfg = lm.config
    lsh_c, local_c = cfg.lsh_attn_chunk_length, cfg.local_attn_chunk_length
    first_lsh = _first_lsh(cfg)
    nbs = [None if first_lsh is None else s.num_buckets[first_lsh] for s in states]
    rows_meta = []
    for s, nb in zip(states, nbs, strict=True):
        p = cfg.padded_length(s.length + 1)
        rows_meta.append([s.slot, s.length, int(p > lsh_c), max(p // lsh_c, 1), int(p <= local_c),
                          s.slot if nb is not None else cache.scratch_slot, int(nb is not None)])
    return rows_meta, nbs


def _step_rows(lm: ReformerLM, cache: DecodeCache, tokens: Tensor, states: list[DecodeState], rows: int,
               graphs: StepGraphs | None = None) -> Tensor:
    """One step over `rows` rows: the states' rows, then padding rows on the scratch slot. With `graphs`, a
    step whose structure it can capture replays a CUDA graph (model/step_graphs.py); others run eagerly."""
    pad = rows - len(states)
    cfg = lm.config
    first_lsh = _first_lsh(cfg)
    rows_meta, nbs = _row_facts(lm, cache, states)
    nbs += [None] * pad
    # padding rows count as hashed (their results are dropped), so a batch of long rows skips the dense path
    rows_meta += [[cache.scratch_slot, 0, 1, 1, 1, cache.scratch_slot, 0]] * pad
    all_hashed = all(m[2] for m in rows_meta)
    meta = torch.tensor(rows_meta, dtype=torch.long)
    if pad:  # F.pad costs a few microseconds even when it adds nothing
        tokens = F.pad(tokens, (0, pad), value=cfg.pad_token_id)
    groups = _bucket_groups(nbs)
    if graphs is not None:
        out = graphs.run(lambda t, m: _step_compute(lm, cache, t, m, all_hashed, groups, first_lsh), tokens, meta,
                         (rows, all_hashed, tuple(str(nb) for nb, _ in groups)), cache, single_group=len(groups) <= 1
                         and all(sel is None for _, sel in groups))
        if out is not None:
            return out
    return _step_compute(lm, cache, tokens, meta.to(cache.device), all_hashed, groups, first_lsh)


def _step_compute(lm: ReformerLM, cache: DecodeCache, tokens: Tensor, meta: Tensor, all_hashed: bool,
                  groups: list[tuple[int | list[int], list[int] | None]], first_lsh: int | None) -> Tensor:
    """The step's device work from its device inputs: tokens (B,) and the rows' facts meta (B, 7); no host
    sync, shapes fixed by B and the cache, so a CUDA graph can capture it. `first_lsh`: the first LSH
    layer's index (its attention sets the window geometry every LSH layer shares), None without one."""
    device = cache.device
    rows = tokens.shape[0]
    slots, t = meta[:, 0], meta[:, 1]
    step = _Step(t=t, blocks=BlockLookup(cache.block_table, slots, cache.block_size),
                 groups=[(nb, None if sel is None else torch.tensor(sel).to(device))
                         for nb, sel in groups], meta=meta)
    if first_lsh is not None and cache.window_kernel is None:  # the C kernel works the windows out itself
        att0 = _layers(lm)[first_lsh].attention.self_attention
        assert isinstance(att0, LSHSelfAttention)
        _lsh_geometry(cache, step, att0, meta, all_hashed, cache.indexes[first_lsh])
    x = lm.embeddings.word_embeddings(tokens) + lm.embeddings.position_embeddings(t)  # (B, hidden)
    x1 = x2 = x
    linear = cache.step_linears  # the step's dense work (model/step_linear.py)
    if linear.uses_kernel(x):
        x2 = x.clone()  # two tensors: the kernel's layer tails update them in place
    new_rows = step.blocks.rows(t.view(-1, 1)).view(-1)  # (B,): where the new keys go
    local: tuple[Tensor, Tensor] | None = None
    for li, p in enumerate(_plan(lm)):
        att = p.attention
        h = linear.norm(p.norm, x2)  # (B, hidden)
        qkv = linear(h, *p.projections).view(rows, len(p.projections), att.heads, att.head_size)  # (B, 2|3, H, D)
        if isinstance(att, LSHSelfAttention):
            qk, v = qkv[:, 0], qkv[:, 1]
            cache.write_step(li, new_rows, qk, v)
            out = _lsh_attend(cache, li, att, qk, step)
        else:
            q, k, v = qkv[:, 0], qkv[:, 1] / math.sqrt(att.head_size), qkv[:, 2]
            cache.write_step(li, new_rows, k, v)
            if local is None:  # every local layer has the same window: built once per step
                local = _local_window(cache, att, step, meta[:, 4].bool())
            out = _local_attend(cache, li, q, local)
        out = out.reshape(rows, -1)  # (B, H*D)
        if not linear.tail(out, x1, x2, p.output, p.ff_norm, p.ff_dense, p.ff_act, p.ff_output):
            x1 = x1 + linear(out, p.output)  # (B, hidden)
            # the feed-forward's chunk in eval: output(act(dense(layer_norm(x))))
            x2 = x2 + linear(p.ff_act(linear(_norm(p.ff_norm, x1), p.ff_dense)), p.ff_output)
    return linear(linear.norm(lm.final_layer_norm, torch.cat([x1, x2], dim=-1)), lm.lm_head)  # (B, vocab)


def _norm(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    """`ln(x)` without nn.Module's call machinery (hooks a step never uses; a few microseconds a call)."""
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


@dataclass(frozen=True)
class _LayerPlan:
    """One layer's modules as a decode step uses them, looked up once per model instead of through
    nn.Module attribute access (about 1 us each, a dozen per layer) at every step. Kept per model (weakly):
    a model's layers are its modules for life; their weights may change (the products follow them)."""
    attention: LSHSelfAttention | LocalSelfAttention
    norm: nn.LayerNorm
    projections: tuple[nn.Linear, ...]  # LSH: query-key, value; local: query, key, value
    output: nn.Linear
    ff_norm: nn.LayerNorm
    ff_dense: nn.Linear
    ff_act: nn.Module
    ff_output: nn.Linear


_PLANS: weakref.WeakKeyDictionary[ReformerLM, list[_LayerPlan]] = weakref.WeakKeyDictionary()


def _plan(lm: ReformerLM) -> list[_LayerPlan]:
    plan = _PLANS.get(lm)
    if plan is None:
        plan = []
        for layer in _layers(lm):
            att, ff = layer.attention.self_attention, layer.feed_forward
            if isinstance(att, LSHSelfAttention):
                projections: tuple[nn.Linear, ...] = (att.query_key, att.value)
            else:
                assert isinstance(att, LocalSelfAttention)
                projections = (att.query, att.key, att.value)
            plan.append(_LayerPlan(att, layer.attention.layer_norm, projections, layer.attention.output,
                                   ff.layer_norm, ff.dense, ff.act, ff.output))
        _PLANS[lm] = plan
    return plan


def _local_window(cache: DecodeCache, att: LocalSelfAttention, step: _Step, dense: Tensor) -> tuple[Tensor, Tensor]:
    """Flat (row, head) indices (B, H, W) into the pools of the new position's local window, and which
    window slots are padding (B, 1, W)."""
    c, t = att.chunk, step.t
    b = t.shape[0]
    start = torch.where(dense, 0, ((torch.div(t, c, rounding_mode="floor") - att.before) * c).clamp(min=0))
    width = (att.before + 1) * c
    pos = start.view(b, 1) + torch.arange(width, device=t.device)  # (B, W)
    absent = pos > t.view(b, 1)
    pos = pos.masked_fill(absent, 0)
    rows = step.blocks.rows(pos)
    flat = rows.unsqueeze(1) * cache.heads + torch.arange(cache.heads, device=t.device).view(1, -1, 1)
    return flat, absent.unsqueeze(1)


def _local_attend(cache: DecodeCache, li: int, q: Tensor, window: tuple[Tensor, Tensor]) -> Tensor:
    flat, absent = window
    if cache.window_kernel is not None:
        b, heads, w = flat.shape
        return cache.window_kernel.attend(q.contiguous(), cache.keys[li].view(-1, cache.head_size), None,
                                          cache.values[li].view(-1, cache.head_size), flat.view(b, heads, 1, w),
                                          absent.view(b, 1, 1, w), None, None, None, 0.0, mask_value(torch.float32))
    keys, _ = cache.gather_keys(li, flat)  # (B, H, W, D)
    dots = torch.matmul(q.unsqueeze(-2), keys.to(q.dtype).transpose(-1, -2)).squeeze(-2)  # (B, H, W), as in _lsh_attend
    dots = dots.masked_fill(absent, mask_value(dots.dtype))
    probs = torch.softmax(dots.float(), dim=-1)
    return cache.weighted_values(li, flat, probs).to(q.dtype)  # (B, H, D)


@dataclass
class _Step:
    t: Tensor  # (B,) the new position of each row
    blocks: BlockLookup  # the pool rows of each row's positions
    groups: list[tuple[int | list[int], Tensor | None]]  # bucket count -> rows (None: every row)
    # LSH layers on the PyTorch path (built once per step by _lsh_geometry; the C kernel needs none of them)
    geo: WindowGeometry | None = None
    base: Tensor | None = None  # (B, H, R) flat (slot, head, round) of the index each row appends to
    value: Tensor | None = None  # (B*H*R,) the new position as the index stores it
    weight: Tensor | None = None  # (B*H*R,) int16: 1 where the row appends
    dense: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # hashed (B,1,1,1), positions, absent, round 0
    meta: Tensor | None = None  # (B, 7) the rows' facts (the C kernel reads them)


def _lsh_geometry(cache: DecodeCache, step: _Step, att: LSHSelfAttention, meta: Tensor, all_hashed: bool,
                  index: LSHIndex | None) -> None:
    assert index is not None
    b, heads, rounds, device = meta.shape[0], att.heads, att.rounds, meta.device
    t = step.t
    step.geo = WindowGeometry(t, meta[:, 3], heads, rounds, att.chunk, att.before, att.after)
    step.base = ((meta[:, 5].view(b, 1) * heads + torch.arange(heads, device=device)).view(b, heads, 1) * rounds
                 + torch.arange(rounds, device=device))
    step.value = index.store(t).view(b, 1).expand(b, heads * rounds).reshape(-1)
    step.weight = meta[:, 6].to(torch.int16).view(b, 1).expand(b, heads * rounds).reshape(-1)
    if not all_hashed:
        # rows still shorter than a chunk attend densely over every position, in round 0 of the same layout
        w = (att.before + 1 + att.after) * att.chunk
        dense_pos = torch.arange(w, device=device).view(1, 1, 1, w)
        round0 = torch.arange(rounds, device=device).view(1, 1, -1, 1) == 0
        dense_absent = (dense_pos > t.view(b, 1, 1, 1)) | ~round0
        step.dense = (meta[:, 2].bool().view(b, 1, 1, 1), dense_pos.masked_fill(dense_absent, 0), dense_absent,
                      round0)


def _bucket_groups(nbs: list[int | list[int] | None]) -> list[tuple[int | list[int], list[int] | None]]:
    """The step's rows by the bucket count they hash with: (count, the rows; None: every row). Rows that keep
    no index (padding, or not hashing yet) may take any count: they append with weight 0 to the scratch
    slot and their window results are dropped or replaced by the dense path, so when the others share one
    count every row hashes with it, in one call over a fixed number of rows."""
    groups: dict[str, tuple[int | list[int], list[int]]] = {}
    for i, nb in enumerate(nbs):
        if nb is not None:
            groups.setdefault(str(nb), (nb, []))[1].append(i)
    if len(groups) == 1:
        return [(nb, None) for nb, _ in groups.values()]
    return [(nb, members) for nb, members in groups.values()]


def _lsh_attend(cache: DecodeCache, li: int, att: LSHSelfAttention, qk: Tensor, step: _Step) -> Tensor:
    b, heads, d = qk.shape
    rounds = att.rounds
    index = cache.indexes[li]
    assert index is not None
    # hash the new query of every row that keeps an index, one call per bucket count in the batch
    hash_rows = cache.step_linears.hash
    if len(step.groups) == 1 and step.groups[0][1] is None:  # every row hashes with one bucket count
        buckets = hash_rows(att, qk, step.groups[0][0])  # (B, H, R)
    else:
        buckets = torch.zeros(b, heads, rounds, dtype=torch.long, device=qk.device)
        for nb, sel in step.groups:
            buckets[sel] = hash_rows(att, qk[sel], nb)
    kernel = cache.window_kernel
    if kernel is not None:
        # two C calls: the insert into the recent order; the windows' positions from the index and the
        # attention over them (model/cpu_kernels.py)
        norms_pool = cache.norms[li]
        assert norms_pool is not None and step.meta is not None
        buckets = buckets.contiguous()
        kernel.append(index, step.meta, buckets)
        return kernel.lsh_attend(
            qk.contiguous(), cache.keys[li].view(-1, d), norms_pool.view(-1), cache.values[li].view(-1, d),
            step.meta, buckets, index, cache.block_table, cache.block_size, cache.scratch_slot, att.chunk,
            att.before, att.after, self_mask_value(torch.float32), mask_value(torch.float32))
    assert step.geo is not None and step.base is not None and step.value is not None and step.weight is not None
    counts = index.append(step.base, buckets, step.value, step.weight)
    pos, absent = index.window(step.base, counts, buckets, step.geo, step.blocks)  # (B, H, R, W)
    w = pos.shape[-1]
    if step.dense is not None:
        hashed, dense_pos, dense_absent, _ = step.dense
        pos = torch.where(hashed, pos, dense_pos)
        absent = torch.where(hashed, absent, dense_absent)
    flat = step.blocks.rows(pos.view(b, -1)).view(b, heads, rounds * w)
    flat = (flat * heads + index.head_offsets).view(b, heads, rounds, w)
    keys, norms = cache.gather_keys(li, flat)  # (B, H, R, W, D), (B, H, R, W)
    assert norms is not None
    # q . length_normalize(k) / sqrt(D), as (q . k) times the key's cached factor; in float32 whatever the
    # model's dtype (q . k of unnormalised half-precision keys overflows fp16), as the softmax and round weights
    # q (1, D) times the keys' transposed view: a row-vector product; keys (W, D) times q (D, 1) takes a
    # matrix-vector path about 6x slower on CPU (torch 2.13, one thread, timed by hand)
    dots = torch.matmul(qk.float().view(b, heads, 1, 1, d), keys.float().transpose(-1, -2)).squeeze(-2)  # (B, H, R, W)
    dots = dots * norms.float()
    # masks replace logits, as in the reference: padding never counts, the query's own position gets -1e5
    dots = dots.masked_fill(pos == step.t.view(b, 1, 1, 1), self_mask_value(dots.dtype))
    dots = dots.masked_fill(absent, mask_value(dots.dtype))
    # the log-sum-exp by hand, reusing its exponentials for the output (torch.logsumexp is a composite of
    # as many ops, and the output would take the exponentials again); every row has a finite maximum (masks
    # are finite), so no infinity guard is needed
    top = dots.amax(dim=-1, keepdim=True)
    e = torch.exp(dots - top)
    total = e.sum(dim=-1, keepdim=True)  # (B, H, R, 1)
    lse = top + torch.log(total)
    if step.dense is not None:
        # a dense row's other rounds see nothing: their weight is exactly 0
        hashed, _, _, round0 = step.dense
        lse = torch.where(hashed | round0, lse, torch.full_like(lse, -math.inf))
    weights = round_weights(lse, dim=2)  # (B, H, R, 1)
    # the rounds' softmaxes and their combination as one weight per window slot: the output is one weighted
    # sum of values per (row, head) over every round's window
    probs = (e * (weights / total)).view(b, heads, rounds * w)
    return cache.weighted_values(li, flat.view(b, heads, rounds * w), probs).to(qk.dtype)  # (B, H, D)
