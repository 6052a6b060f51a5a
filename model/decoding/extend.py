"""Extend: S new tokens of one request against its decode cache in one call, leaving exactly what S decode steps
(`Decoder.step`, one token each) leave: the same logits after the last token and the same bits in every cached
tensor (keys, values, key factors, local rings, each LSH index's orders and counts). One causal semantics for
a request's tokens however they arrive: a position's window is a pure function of the positions before it,
as a decode step's is, not the one-piece prefill's (model/decoding/prefill/, which sorts a whole prompt, so a
position's keys there depend on later tokens).

Where it runs:
- the C path (model/decoding/steps/fused_extend.py, model/kernels/csrc/extend_layers.c), where the decoder has
  the one-call C step (a float32 CPU cache with the kernels loaded) and every LSH layer has a fixed bucket
  count: the S rows' layer norms, products, hashes and tails batched layer by layer (each row computed alone,
  so its bits are one row's); per layer, every row's cache writes in order as the steps make them (an LSH
  layer's merges put off to one after the last row, which leaves the same orders), then every row's attention
  over the window a step at its position sees: an LSH row's window read from the final index through the
  bucket counts as they stood at its position, a local row's from a copy of the positions it covers, with
  attend_slots' arithmetic slot by slot, the rows of a block taken in the order of their windows so that
  overlapping windows share the key and value rows in cache (extend_windows.c, extend_local.c);
- elsewhere, the reference path: one `Decoder.step` per token (on the PyTorch step, a row's bits depend on
  its batch, so batching its products would not be exact; automatic bucket counts rebuild indexes between
  steps, which the C call does not do). Exact by construction; no faster than the steps.

`all_logits` (prompt scoring under the causal prefill, service/engine/runner.py `extend_slices`): every token's
logits, not only the last's; on the C path the last layer then attends, and the final layer norm and the LM
head run, at every row (extend_layers.c `all_rows`), each row's the bits its step returns; on the reference
path the steps' logits stacked. The cache left is the same either way.

tests/model/decoding/test_extend.py checks the C path against the reference path with `torch.equal`, and
tests/model/decoding/test_extend_all_logits.py every row's logits against the steps'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from ..attention import LSHSelfAttention
from .cache import flat_buckets
from .cache_state import DecodeState
from .facts import position_facts
from .plan import layer_plan
from .steps.fused_extend import extend_rows

if TYPE_CHECKING:
    from ..reformer import ReformerLM
    from .cache import DecodeCache
    from .steps.backends import StepBackends


class DecoderLike(Protocol):
    """What extend uses of a decoder (model/decoding/step.py `Decoder`, which imports this module): its model,
    cache and backends, and its step for the reference path."""

    lm: ReformerLM
    cache: DecodeCache
    backends: StepBackends

    def step(self, tokens: Tensor | Sequence[int], states: Sequence[DecodeState]) -> Tensor: ...


# The most rows one C call takes: its buffers hold about (4 * hidden + 7 * heads * head size + feed-forward)
# floats a row (7.5 KB on the shipped model: 30 MB for 4,096 rows), and each thread's attention scratch about
# 9 bytes a window slot for a block of up to 1,024 rows (4.7 MB on the shipped model) plus 4 bytes a position
# and hash round (the final orders); a longer extend is cut into calls of this many rows, which leaves the same
# bits (each call leaves the cache a step would).
EXTEND_ROWS = 4096


def open_indexes(decoder: DecoderLike, state: DecodeState) -> None:
    """Give a request that holds no position yet (allocated, never prefilled) its empty LSH indexes where the
    model has a fixed bucket count: what a prefill's index build does for an empty prompt, so that decode
    steps (and extend) from position 0 keep its index. Automatic counts build theirs when the request first
    hashes (model/decoding/index_upkeep.py). Does nothing once the request holds positions."""
    if state.length:
        return
    cache = decoder.cache
    for li, p in enumerate(layer_plan(decoder.lm)):
        att, index = p.attention, cache.indexes[li]
        if not isinstance(att, LSHSelfAttention) or index is None or state.num_buckets[li] is not None:
            continue
        nb = att.config.num_buckets
        if nb is None:
            continue
        index.grow_buckets(flat_buckets(nb))
        index.main_counts[state.slot] = 0
        index.recent_counts[state.slot] = 0
        state.num_buckets[li], state.index_len[li] = nb, 0


def c_path(decoder: DecoderLike) -> bool:
    """Whether `extend` runs in C for this decoder: the one-call step and its window functions are there and
    every LSH layer hashes with a fixed bucket count."""
    backends = decoder.backends
    fixed = all(not isinstance(p.attention, LSHSelfAttention) or p.attention.config.num_buckets is not None
                for p in layer_plan(decoder.lm))
    return fixed and backends.fused is not None and backends.window is not None


@torch.no_grad()
def extend(decoder: DecoderLike, state: DecodeState, tokens: Sequence[int], all_logits: bool = False) -> Tensor:
    """Append `tokens` (host ints, at least one) to the request `state`; returns the logits (vocab,) for the
    position after the last, as `Decoder.step` fed them one at a time returns them. `all_logits`: every
    token's logits instead, (S, vocab), row t those the step that reads token t returns (prompt scoring:
    row t predicts token t+1); the cache is left as without it. The caller bounds S, which this holds S x vocab
    floats for (service/engine/runner.py reads a scored prompt in slices)."""
    lm, cache = decoder.lm, decoder.cache
    ids = [int(t) for t in tokens]
    if not ids:
        raise ValueError("extend needs at least one token")
    if state.slot < 0:
        raise ValueError("extending a request whose cache was freed")
    end = state.length + len(ids)
    if end > lm.config.max_position_embeddings:
        raise ValueError(f"extending past max_position_embeddings {lm.config.max_position_embeddings}")
    if end > state.capacity * cache.block_size:
        raise ValueError(f"extending past the {state.capacity * cache.block_size} positions reserved")
    open_indexes(decoder, state)
    rows: list[Tensor] = []  # each call's logits: its last row's (vocab,), or all_logits its (part, vocab)
    if c_path(decoder):
        # the fixed bucket count (c_path), or none to hash with: a model without LSH layers
        count = lm.config.num_buckets if lm.config.num_buckets is not None else 0
        window, fused = decoder.backends.window, decoder.backends.fused
        assert fused is not None
        for start in range(0, len(ids), EXTEND_ROWS):
            part = ids[start : start + EXTEND_ROWS]
            out = extend_rows(fused, lm, cache, window, torch.tensor(part, dtype=torch.int64),
                              position_facts(lm, cache, state, len(part)), count, state.index_len, all_logits)
            if out is None:  # the one-call path does not apply to this model: the steps take the rest
                ids = ids[start:]
                break
            state.length += len(part)
            rows.append(out)
        else:
            ids = []
    for token in ids:
        logits = decoder.step([token], [state])[0]
        rows.append(logits.unsqueeze(0) if all_logits else logits)
    if all_logits:
        return rows[0] if len(rows) == 1 else torch.cat(rows)
    return rows[-1]


__all__ = ["EXTEND_ROWS", "c_path", "extend", "open_indexes"]
