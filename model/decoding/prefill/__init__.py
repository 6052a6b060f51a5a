"""Prefill: prompts through the full forward, each layer's keys and values (and LSH indexes) into the cache, in
slices a caller can interleave with decode steps (chunked prefill)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...attention import LocalSelfAttention, LSHSelfAttention
from ...batch import prepare_batch
from ...feedforward import EVAL_CHUNK
from .. import rehash_ahead
from ..cache import DecodeCache
from ..cache_state import DecodeState
from ..index_upkeep import build_index_steps, coming_count, index_buckets, row_buckets
from ..plan import layers_of
from .row_blocks import in_blocks, position_blocks, rows_in_blocks
from .scores import PromptScores, score_prompts
from .slices import DEFAULT_SLICE_CHUNKS, at_positions, layer_f_slices, projections

if TYPE_CHECKING:
    from ...reformer import ReformerLM

__all__ = ["WRITE_ROWS", "PromptScores", "prefill", "prefill_scored_steps", "prefill_steps"]


# A prefill writes its keys and values into the cache this many positions at a time, yielding between: the
# first prompt to reach fresh pool pages faults them in as it writes (a 60K prompt's write of one layer took
# 160-180 ms in one piece, 30-50 ms once the pages were there: a scratch slice-by-slice timing of the prefill,
# shipped model, one thread, load not recorded)
WRITE_ROWS = 8192


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
    """`prefill_scored_steps` scoring nothing: the logits after each prompt and the states."""
    logits, states, _ = yield from prefill_scored_steps(lm, cache, prompts, reserve, slice_chunks)
    return logits, states


def prefill_scored_steps(lm: ReformerLM, cache: DecodeCache, prompts: Sequence[Tensor],
                         reserve: Sequence[int] | None = None, slice_chunks: int = DEFAULT_SLICE_CHUNKS,
                         score: Sequence[int | None] | None = None
                         ) -> Generator[None, None, tuple[Tensor, list[DecodeState], list[PromptScores | None]]]:
    """`score[i]` None or k: prompt i is also scored by this forward, each position's next-token log-probability
    and top k (model/decoding/prefill/scores.py; the last layer then runs at every position, not only the
    last). Returns the logits, the states and each prompt's PromptScores (None where not asked).

    `prefill` in slices: it yields after the embeddings, each projection and cache write, each LSH index build,
    each `slice_chunks` chunk-window attentions (model/decoding/prefill/slices.py) and each feed-forward slice, so a
    caller can run decode steps in between (chunked prefill); the embeddings, layer norms, projections and
    hashing of a long prompt also between blocks of positions (model/decoding/prefill/row_blocks.py). The
    bucket sort still sees the whole prompt; the result is the same bits. Closing it early frees what it
    allocated."""
    lengths = [int(p.shape[0]) for p in prompts]
    if min(lengths, default=1) < 1:
        raise ValueError("prefill needs non-empty prompts")
    want = list(reserve) if reserve is not None else lengths
    states: list[DecodeState] = []
    try:
        for n, w in zip(lengths, want, strict=True):
            states.append(cache.allocate(max(n, w)))
        with torch.no_grad():
            asked = list(score) if score is not None else [None] * len(prompts)
            result = yield from _prefill_layers(lm, cache, prompts, lengths, states, slice_chunks, asked)
            lsh = [(li, att) for li, layer in enumerate(layers_of(lm))
                   if isinstance(att := layer.attention.self_attention, LSHSelfAttention)]
            for state in states:  # close to a bucket-count change: hashed ahead now (model/decoding/rehash_ahead.py)
                coming = coming_count(lm, cache, state, lsh)
                while coming is not None and rehash_ahead.advance(cache, state, lsh, coming):
                    yield
    except BaseException:
        for s in states:
            cache.free(s)
        raise
    return result


def _sum_in_blocks(x: Tensor, y: Tensor) -> Generator[None, None, Tensor]:
    """x + y for x and y (N, L, hidden), in blocks of positions (model/decoding/prefill/row_blocks.py)."""
    return (yield from in_blocks(lambda a, z: x[:, a:z] + y[:, a:z], x.shape[0], x.shape[1], x.device))


def _ring_kept(cache: DecodeCache, states: Sequence[DecodeState], lengths: Sequence[int]
               ) -> tuple[Tensor, Tensor, Tensor]:
    """What a prefill writes to the local layers' rings (model/decoding/local_ring.py): each prompt's last
    positions within its window, as (prompt, position) pairs (K,) each, and their ring rows (K,), all distinct."""
    prompt, position, slot = [], [], []
    for i, (state, n) in enumerate(zip(states, lengths, strict=True)):
        kept = torch.arange(cache.ring.kept(n).start, n)
        position.append(kept)
        prompt.append(torch.full_like(kept, i))
        slot.append(torch.full_like(kept, state.slot))
    at = cache.ring.rows(torch.cat(slot), torch.cat(position))  # (K,)
    return torch.cat(prompt).to(cache.device), torch.cat(position).to(cache.device), at.to(cache.device)


def _prefill_layers(lm: ReformerLM, cache: DecodeCache, prompts: Sequence[Tensor], lengths: list[int],
                    states: list[DecodeState], slice_chunks: int = DEFAULT_SLICE_CHUNKS,
                    asked: Sequence[int | None] = ()
                    ) -> Generator[None, None, tuple[Tensor, list[DecodeState], list[PromptScores | None]]]:
    scoring = any(k is not None for k in asked)
    longest = max(lengths)
    ids = torch.full((len(prompts), longest), lm.config.pad_token_id, dtype=torch.long, device=cache.device)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long, device=cache.device)
    for i, p in enumerate(prompts):
        ids[i, : lengths[i]] = p.to(cache.device)
        mask[i, : lengths[i]] = 1
    batch = prepare_batch(ids, None if min(lengths) == longest else mask, lm.config)  # right-padded: no shift
    ctx = batch.context
    n = len(prompts)
    # the embeddings, layer norms and projections of the whole prompt in blocks of positions, yielding
    # between (model/decoding/prefill/row_blocks.py: each position's are its own, the same bits)
    tokens = batch.input_ids  # (N, padded length)
    x1 = x2 = yield from in_blocks(lambda a, z: lm.embeddings(tokens[:, a:z], start=a), n, tokens.shape[1],
                                   tokens.device)
    yield
    pos = torch.arange(longest, device=cache.device)
    slots = torch.tensor([s.slot for s in states], device=cache.device)
    rows = cache.rows(slots, pos.expand(len(prompts), longest))  # (N, L)
    ring_kept = _ring_kept(cache, states, lengths) if cache.ring.width else None
    real = mask.bool()
    last = torch.tensor(lengths, device=cache.device) - 1
    layers = layers_of(lm)
    # a prompt of several blocks of positions: its whole-prompt tensors are large enough that freeing them
    # gets pieces of its own (below)
    long = len(position_blocks(n, tokens.shape[1], tokens.device)) > 1
    for li, layer in enumerate(layers):
        att = layer.attention.self_attention
        assert isinstance(att, LSHSelfAttention | LocalSelfAttention)
        # the attention's projections (and an LSH layer's hashing) of the padded batch, computed once: the
        # cache keeps what the attention below attends with (a 64K prompt's projections and hash are ~0.6 s
        # a layer on this project's CPU)
        normed = yield from rows_in_blocks(layer.attention.layer_norm, x2)
        if long:
            yield
        given = yield from projections(att, normed, ctx)
        # whole-prompt tensors are dropped as soon as they are last used, so their frees (about 35 ms per
        # 512 MB on this project's CPU) fall in different pieces: left to the prefill's end, a 500K-token
        # prompt's took 0.21 s in its last piece
        del normed
        keys, values = given.key[:, :, :longest], given.value[:, :, :longest]  # (N, H, L, D)
        if cache.is_ring(li):
            # a local layer keeps each prompt's last window of positions in its slot's ring (distinct rows):
            # those positions alone are gathered, (K, H, D)
            assert ring_kept is not None
            prompt, position, at = ring_kept
            flat_keys, flat_values = keys.transpose(1, 2)[prompt, position], values.transpose(1, 2)[prompt, position]
        else:
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
                nb = index_buckets(att, lm.config.padded_length(lengths[i]))
                if nb is not None:
                    hashed = row_buckets(att, given.buckets, ctx, i, nb)
                    yield from build_index_steps(cache, li, att, state, keys[i, :, : lengths[i]], nb,
                                                  None if hashed is None else hashed[:, :, : lengths[i]])
        # the layer as ReformerLayer.forward computes it (eval, no dropout), its attention in slices of chunks.
        # The last layer's outputs feed only the logits after each prompt: its output projection and
        # feed-forward run on those positions alone (its keys and values, above, cover every position)
        if li == len(layers) - 1 and not scoring:
            x1 = at_positions(x1, last) + (yield from layer_f_slices(layer, x2, ctx, slice_chunks, given, last))
            if long:
                yield  # the whole prompt's x1 was freed: its x2 in the next piece
            x2 = at_positions(x2, last) + layer.feed_forward(x1)  # (N, 1, hidden)
            if long:
                yield
            break
        f_out = yield from layer_f_slices(layer, x2, ctx, slice_chunks, given)
        # the residual sum in blocks of positions (elementwise: the same bits as one add): in one piece, a
        # 131K-token prompt's took 0.18-0.19 s, most of it faulting in the new tensor's pages
        x1 = yield from _sum_in_blocks(x1, f_out)
        del f_out
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
    del given, keys, values, flat_keys, flat_values  # the last layer's projections
    if long:
        yield
    scores: list[PromptScores | None] = [None] * len(prompts)
    if scoring:  # every position's streams are here: score them, then keep each prompt's last
        scores = yield from score_prompts(lm, x1, x2, tokens, lengths, asked)
        x1, x2 = at_positions(x1, last), at_positions(x2, last)  # (N, 1, hidden)
    hidden = torch.cat([x1, x2], dim=-1)[:, 0]  # (N, 2*hidden): after each prompt's last position
    for state, n in zip(states, lengths):
        state.length = n
    return lm.lm_head(lm.final_layer_norm(hidden)), states, scores

