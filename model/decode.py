"""Incremental decoding with an exact LSH window cache.

Prefill runs the prompt once and keeps, per layer, the keys and values of every position (LSH: the shared
query/key projection) and, per LSH head and hash round, the positions grouped by bucket. A decode step
computes the new position's hidden state layer by layer:

- local layers attend over the cached keys of the new position's chunk window;
- LSH layers hash the new query with the model's rotations, find in every round the slot it takes in the
  bucket-sorted order of all positions (`BucketIndex`), and attend to exactly the keys a full forward's
  last position sees there: its chunk and the chunks before it in the row's own padded layout, wrapping
  into the previous round as the full forward does; rounds are combined by their log-sum-exp weights.

The new position's result equals the full forward's last position whenever the cached keys equal the full
forward's (local-only models; LSH layers whose inputs come from local layers only). Deeper LSH stacks keep
earlier positions' states as they were computed, which is what makes the cost per token independent of
the prompt length (bench/decode_quality.py measures the difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .attention import LocalSelfAttention, LSHSelfAttention, length_normalize, split_heads
from .bucket_index import BucketIndex
from .chunking import mask_value, self_mask_value

if TYPE_CHECKING:
    from .reformer import ReformerLM
    from .reversible import ReformerLayer


HEADROOM = 256  # decode steps before the first cache growth


def _with_headroom(x: Tensor) -> Tensor:
    """(H, T, D) -> (H, T + HEADROOM, D) storage holding x first."""
    out = x.new_empty(x.shape[0], x.shape[1] + HEADROOM, x.shape[2])
    out[:, : x.shape[1]] = x
    return out


@dataclass
class LayerCache:
    kind: str
    keys: Tensor  # (H, capacity, D): LSH: shared query/key projection; local: scaled keys
    values: Tensor  # (H, capacity, D)
    index: list[list[BucketIndex]] | None = None  # LSH: [head][round]
    num_buckets: int | list[int] | None = None  # the bucket count `index` was built for

    def put(self, t: int, key: Tensor, value: Tensor) -> None:
        if t >= self.keys.shape[1]:
            grow = max(self.keys.shape[1], 64)
            self.keys = torch.cat([self.keys, self.keys.new_empty(self.keys.shape[0], grow, self.keys.shape[2])], 1)
            self.values = torch.cat([self.values, self.values.new_empty(self.keys.shape[0], grow,
                                                                         self.values.shape[2])], 1)
        self.keys[:, t] = key
        self.values[:, t] = value


@dataclass
class DecodeState:
    """Everything one request needs to go on decoding; dropped (and freed) when the request ends."""

    length: int = 0
    ids: list[int] = field(default_factory=list)
    layers: list[LayerCache] = field(default_factory=list)

    def nbytes(self) -> int:
        total = 0
        for cache in self.layers:
            total += 2 * cache.keys.shape[0] * self.length * cache.keys.shape[2] * cache.keys.element_size()
            if cache.index is not None:
                total += sum(ix.nbytes() for row in cache.index for ix in row)
        return total


def _flat_buckets(nb: int | list[int]) -> int:
    return nb if isinstance(nb, int) else math.prod(nb)


def _build_index(att: LSHSelfAttention, qk: Tensor, nb: int | list[int]) -> list[list[BucketIndex]]:
    """qk (H, T, D) -> per head and round, positions grouped by bucket."""
    buckets = att.hash(qk.unsqueeze(0), nb, None)[0].cpu().numpy()  # (H, R, T)
    return [[BucketIndex.from_buckets(buckets[h, r], _flat_buckets(nb)) for r in range(buckets.shape[1])]
            for h in range(buckets.shape[0])]


@torch.no_grad()
def prefill(lm: ReformerLM, input_ids: Tensor) -> tuple[Tensor, DecodeState]:
    """Run the prompt (L,) once; returns the last position's logits (vocab,) and the decoding state."""
    ids = input_ids.reshape(1, -1)
    t = ids.shape[1]
    padded, ctx, _ = lm._prepare(ids, None)
    x1 = x2 = lm.embeddings(padded)
    state = DecodeState(length=t, ids=[int(i) for i in ids[0].tolist()])
    for layer in _layers(lm):
        att = layer.attention.self_attention
        h = layer.attention.layer_norm(x2[:, :t])  # (1, t, hidden)
        if isinstance(att, LSHSelfAttention):
            keys = split_heads(att.query_key(h), att.heads, att.head_size)[0]  # (H, t, D)
            cache = LayerCache("lsh", _with_headroom(keys),
                               _with_headroom(split_heads(att.value(h), att.heads, att.head_size)[0]))
            lp = lm.config.padded_length(t)
            if lp > att.chunk or att.config.num_buckets is not None:
                cache.num_buckets = att.num_buckets_for(lp) if lp > att.chunk else att.config.num_buckets
                assert cache.num_buckets is not None
                cache.index = _build_index(att, cache.keys[:, :t], cache.num_buckets)
        else:
            assert isinstance(att, LocalSelfAttention)
            keys = split_heads(att.key(h), att.heads, att.head_size)[0] / math.sqrt(att.head_size)
            cache = LayerCache("local", _with_headroom(keys),
                               _with_headroom(split_heads(att.value(h), att.heads, att.head_size)[0]))
        state.layers.append(cache)
        x1, x2, _ = layer(x1, x2, ctx)
    hidden = lm.final_layer_norm(torch.cat([x1, x2], dim=-1)[:, t - 1])  # (1, 2*hidden)
    return lm.lm_head(hidden)[0], state


@torch.no_grad()
def decode_step(lm: ReformerLM, token_ids: Tensor, states: list[DecodeState]) -> Tensor:
    """Append one token to each request; returns the logits (B, vocab) for the position after it.
    Each request is computed on its own, so its logits are bit-identical whatever it is batched with
    (a batched matmul rounds differently from a single-row one)."""
    tokens = token_ids.reshape(-1).tolist()
    if len(tokens) != len(states):
        raise ValueError(f"{len(tokens)} tokens for {len(states)} decoding states")
    return torch.stack([_step_one(lm, int(tok), state) for tok, state in zip(tokens, states)])


def _step_one(lm: ReformerLM, token: int, state: DecodeState) -> Tensor:
    device = next(lm.parameters()).device
    t = state.length
    if t >= lm.config.max_position_embeddings:
        raise ValueError(f"decoding past max_position_embeddings {lm.config.max_position_embeddings}")
    x = lm.embeddings.word_embeddings(torch.tensor([token], device=device)) + \
        lm.embeddings.position_embeddings(torch.tensor([t], device=device))  # (1, hidden)
    x1 = x2 = x
    for layer, cache in zip(_layers(lm), state.layers):
        att = layer.attention.self_attention
        h = layer.attention.layer_norm(x2)[0]  # (hidden,)
        if isinstance(att, LSHSelfAttention):
            qk = att.query_key(h).view(att.heads, att.head_size)
            v = att.value(h).view(att.heads, att.head_size)
            out = _lsh_step(lm, att, cache, qk, v, t)
        else:
            assert isinstance(att, LocalSelfAttention)
            q = att.query(h).view(att.heads, att.head_size)
            k = att.key(h).view(att.heads, att.head_size) / math.sqrt(att.head_size)
            v = att.value(h).view(att.heads, att.head_size)
            out = _local_step(lm, att, cache, q, k, v, t)
        x1 = x1 + layer.attention.output(out.reshape(1, -1))  # (1, hidden)
        x2 = x2 + layer.feed_forward(x1.unsqueeze(1)).squeeze(1)
    logits = lm.lm_head(lm.final_layer_norm(torch.cat([x1, x2], dim=-1)))[0]  # (vocab,)
    state.length += 1
    state.ids.append(token)
    return logits


def _layers(lm: ReformerLM) -> list[ReformerLayer]:
    return list(lm.layers)  # type: ignore[arg-type]


def _local_step(lm: ReformerLM, att: LocalSelfAttention, cache: LayerCache, q: Tensor, k: Tensor, v: Tensor,
                t: int) -> Tensor:
    cache.put(t, k, v)
    c = att.chunk
    lp = lm.config.padded_length(t + 1)
    start = 0 if lp <= c else max(0, (t // c - att.before) * c)
    keys, values = cache.keys[:, start : t + 1], cache.values[:, start : t + 1]  # (H, W, D)
    dots = torch.einsum("hd,hwd->hw", q, keys)
    probs = torch.softmax(dots, dim=-1)
    return torch.einsum("hw,hwd->hd", probs, values)  # (H, D)


def _lsh_step(lm: ReformerLM, att: LSHSelfAttention, cache: LayerCache, qk: Tensor, v: Tensor, t: int) -> Tensor:
    cache.put(t, qk, v)
    total = t + 1
    lp = lm.config.padded_length(total)
    c = att.chunk
    scale = math.sqrt(att.head_size)
    if lp <= c:
        # the full forward's dense attention over every position; the query masks itself
        if att.config.num_buckets is not None:
            _index_append(att, cache, qk, t, att.config.num_buckets)
        keys = length_normalize(cache.keys[:, :total]) / scale  # (H, T, D)
        dots = torch.einsum("hd,htd->ht", qk, keys)
        dots[:, t] = self_mask_value(dots.dtype)
        probs = torch.softmax(dots, dim=-1)
        return torch.einsum("ht,htd->hd", probs, cache.values[:, :total])
    nb = att.num_buckets_for(lp)
    if cache.index is None or cache.num_buckets != nb:
        # first hashed step, or an automatic bucket count that changed with the length: rehash everything
        cache.num_buckets = nb
        cache.index = _build_index(att, cache.keys[:, :total], nb)
        slots = _slots_of_last(cache.index)
    else:
        slots = _index_append(att, cache, qk, t, nb)
    heads, rounds = len(cache.index), att.rounds
    n_chunks = lp // c
    windows: list[list[list[int]]] = []
    for hd in range(heads):
        per_round = []
        for r in range(rounds):
            j = slots[hd][r] // c
            keys_at: list[int] = []
            for off in range(-att.before, att.after + 1):
                g = (r * n_chunks + j + off) % (rounds * n_chunks)
                r2, j2 = divmod(g, n_chunks)
                keys_at.extend(cache.index[hd][r2].slots(j2 * c, (j2 + 1) * c))  # padding slots do not exist
            per_round.append(keys_at)
        windows.append(per_round)
    width = max(len(w) for row in windows for w in row)
    idx = np.full((heads, rounds, width), -1, dtype=np.int64)
    for hd in range(heads):
        for r in range(rounds):
            idx[hd, r, : len(windows[hd][r])] = windows[hd][r]
    index = torch.from_numpy(idx).to(qk.device)
    present = index >= 0
    # one row gather from the flattened cache (index_select stays cheap however long the cache grows)
    capacity = cache.keys.shape[1]
    rows = (index.clamp(min=0) + torch.arange(heads, device=qk.device).view(heads, 1, 1) * capacity).reshape(-1)
    d = cache.keys.shape[2]
    keys = cache.keys.reshape(-1, d).index_select(0, rows).view(heads, rounds, width, d)
    keys = length_normalize(keys) / scale  # (H, R, W, D)
    values = cache.values.reshape(-1, d).index_select(0, rows).view(heads, rounds, width, d)
    dots = torch.einsum("hd,hrwd->hrw", qk, keys)
    # masks replace logits, as in the reference: padding never counts, the query's own position gets -1e5
    dots = dots.masked_fill(~present, mask_value(dots.dtype))
    dots = dots.masked_fill(index == t, self_mask_value(dots.dtype))
    lse = torch.logsumexp(dots, dim=-1, keepdim=True)  # (H, R, 1)
    out = torch.einsum("hrw,hrwd->hrd", torch.exp(dots - lse), values)  # (H, R, D)
    weights = torch.exp(lse - torch.logsumexp(lse, dim=1, keepdim=True))  # (H, R, 1)
    return (out * weights).sum(dim=1)  # (H, D)


def _index_append(att: LSHSelfAttention, cache: LayerCache, qk: Tensor, t: int, nb: int | list[int]) -> list[list[int]]:
    if cache.index is None:
        cache.num_buckets = nb
        cache.index = _build_index(att, cache.keys[:, : t + 1], nb)
        return _slots_of_last(cache.index)
    buckets = att.hash(qk.view(1, att.heads, 1, att.head_size), nb, None)[0, :, :, 0].tolist()  # (H, R)
    return [[cache.index[h][r].append(t, buckets[h][r]) for r in range(len(buckets[h]))]
            for h in range(len(buckets))]


def _slots_of_last(index: list[list[BucketIndex]]) -> list[list[int]]:
    return [[ix.slot_of_last() for ix in row] for row in index]
