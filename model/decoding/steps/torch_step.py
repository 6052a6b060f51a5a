"""The decode step's math in PyTorch: embeddings, each layer's norm, projections, cache write, attention over
the new position's window (local, or LSH through the index) and tail, then the LM head. Every op reads only
the step's device inputs and the cache's tensors, so CUDA graphs can capture it (cuda_graphs.py); on the CPU
its attention and products take the C kernels where the cache has them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...attention import LocalSelfAttention, LSHSelfAttention
from ...chunking import mask_value, round_weights, self_mask_value
from ...kernels.abi import Meta
from ...lsh.successor import no_key_threshold
from ..lsh_index import BlockLookup, LSHIndex, WindowGeometry
from ..plan import layer_plan, layers_of

if TYPE_CHECKING:
    from ...reformer import ReformerLM
    from ..cache import DecodeCache
    from .backends import StepBackends


def step_compute(lm: ReformerLM, cache: DecodeCache, backends: StepBackends, tokens: Tensor, meta: Tensor,
                 all_hashed: bool, groups: list[tuple[int | list[int], list[int] | None]], first_lsh: int | None
                 ) -> Tensor:
    """The step's device work from its device inputs: tokens (B,) and the rows' facts meta (B, 7); no host
    sync, shapes fixed by B and the cache, so a CUDA graph can capture it. `backends`: the C window
    functions and products where they run (model/decoding/steps/backends.py). `first_lsh`: the first LSH
    layer's index (its attention sets the window geometry every LSH layer shares), None without one."""
    device = cache.device
    rows = tokens.shape[0]
    slots, t = meta[:, Meta.SLOT], meta[:, Meta.POSITION]
    step = StepInputs(t=t, blocks=BlockLookup(cache.block_table, slots, cache.block_size),
                      orders=BlockLookup(cache.order_table, slots, cache.block_size),
                      groups=[(nb, None if sel is None else torch.tensor(sel).to(device))
                              for nb, sel in groups], meta=meta, backends=backends)
    if first_lsh is not None and backends.window is None:  # the C kernel works the windows out itself
        att0 = layers_of(lm)[first_lsh].attention.self_attention
        assert isinstance(att0, LSHSelfAttention)
        _lsh_geometry(cache, step, att0, meta, all_hashed, cache.indexes[first_lsh])
    x = lm.embeddings.word_embeddings(tokens) + lm.embeddings.position_embeddings(t)  # (B, hidden)
    x1 = x2 = x
    linear = backends.linears  # the step's dense work (model/decoding/steps/linear.py)
    if linear.uses_kernel(x):
        x2 = x.clone()  # two tensors: the kernel's layer tails update them in place
    new_rows = step.blocks.rows(t.view(-1, 1)).view(-1)  # (B,): where an LSH layer's new keys go
    ring_rows: Tensor | None = None  # (B,): where a local layer's go, in its ring (model/decoding/local_ring.py)
    prev_rows: Tensor | None = None  # (B,): where successor-value heads put the new values (position t - 1)
    local: tuple[Tensor, Tensor] | None = None
    for li, p in enumerate(layer_plan(lm)):
        att = p.attention
        h = linear.norm(p.norm, x2)  # (B, hidden)
        qkv = linear(h, *p.projections).view(rows, len(p.projections), att.heads, att.head_size)  # (B, 2|3, H, D)
        if isinstance(att, LSHSelfAttention):
            qk, v = qkv[:, 0], qkv[:, 1]
            if att.successor_heads and prev_rows is None:
                # a padding row's position is 0: its "previous" row is its own (scratch, dropped)
                prev_rows = step.blocks.rows((t - 1).clamp(min=0).view(-1, 1)).view(-1)
            cache.write_step(li, new_rows, qk, v, att.successor_heads, prev_rows)
            out = _lsh_attend(cache, li, att, qk, step)
        else:
            q, k, v = qkv[:, 0], qkv[:, 1] / math.sqrt(att.head_size), qkv[:, 2]
            if ring_rows is None:
                ring_rows = cache.ring.rows(slots, t.view(-1, 1)).view(-1)
            cache.write_step(li, ring_rows, k, v)
            if local is None:  # every local layer has the same window: built once per step
                local = _local_window(cache, att, step, slots, meta[:, Meta.LOCAL_DENSE].bool())
            out = _local_attend(cache, backends, li, q, local)
        out = out.reshape(rows, -1)  # (B, H*D)
        if not linear.tail(out, x1, x2, p.output, p.ff_norm, p.ff_dense, p.ff_act, p.ff_output):
            x1 = x1 + linear(out, p.output)  # (B, hidden)
            # the feed-forward's chunk in eval: output(act(dense(layer_norm(x))))
            x2 = x2 + linear(p.ff_act(linear(_norm(p.ff_norm, x1), p.ff_dense)), p.ff_output)
    return linear(linear.norm(lm.final_layer_norm, torch.cat([x1, x2], dim=-1)), lm.lm_head)  # (B, vocab)


def _norm(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    """`ln(x)` without nn.Module's call machinery (hooks a step never uses; a few microseconds a call)."""
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)



def _local_window(cache: DecodeCache, att: LocalSelfAttention, step: StepInputs, slots: Tensor, dense: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """Flat (row, head) indices (B, H, W) into the local layers' rings (model/decoding/local_ring.py) of the
    new position's local window of the rows of `slots` (B,), and which window slots are padding (B, 1, W)."""
    c, t = att.chunk, step.t
    b = t.shape[0]
    start = torch.where(dense, 0, ((torch.div(t, c, rounding_mode="floor") - att.before) * c).clamp(min=0))
    width = (att.before + 1) * c
    pos = start.view(b, 1) + torch.arange(width, device=t.device)  # (B, W)
    absent = pos > t.view(b, 1)
    pos = pos.masked_fill(absent, 0)
    rows = cache.ring.rows(slots, pos)  # (B, W)
    flat = rows.unsqueeze(1) * cache.heads + torch.arange(cache.heads, device=t.device).view(1, -1, 1)
    return flat, absent.unsqueeze(1)


def _local_attend(cache: DecodeCache, backends: StepBackends, li: int, q: Tensor, window: tuple[Tensor, Tensor]
                  ) -> Tensor:
    flat, absent = window
    if backends.window is not None:
        b, heads, w = flat.shape
        return backends.window.attend(q.contiguous(), cache.keys[li].view(-1, cache.head_size), None,
                                          cache.values[li].view(-1, cache.head_size), flat.view(b, heads, 1, w),
                                          absent.view(b, 1, 1, w), None, None, None, 0.0, mask_value(torch.float32))
    keys, _ = cache.gather_keys(li, flat)  # (B, H, W, D)
    dots = torch.matmul(q.unsqueeze(-2), keys.to(q.dtype).transpose(-1, -2)).squeeze(-2)  # (B, H, W), as in _lsh_attend
    dots = dots.masked_fill(absent, mask_value(dots.dtype))
    probs = torch.softmax(dots.float(), dim=-1)
    return cache.weighted_values(li, flat, probs).to(q.dtype)  # (B, H, D)


@dataclass
class StepInputs:
    t: Tensor  # (B,) the new position of each row
    blocks: BlockLookup  # the pool rows of each row's positions
    orders: BlockLookup  # the items rows of each row's main-order indices (the cache's order table)
    groups: list[tuple[int | list[int], Tensor | None]]  # bucket count -> rows (None: every row)
    backends: StepBackends  # the C window functions and products where they run
    # LSH layers on the PyTorch path (built once per step by _lsh_geometry; the C kernel needs none of them)
    geo: WindowGeometry | None = None
    base: Tensor | None = None  # (B, H, R) flat (slot, head, round) of the index each row appends to
    value: Tensor | None = None  # (B*H*R,) the new position as the index stores it
    weight: Tensor | None = None  # (B*H*R,) int16: 1 where the row appends
    dense: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # hashed (B,1,1,1), positions, absent, round 0
    meta: Tensor | None = None  # (B, 7) the rows' facts (the C kernel reads them)


def _lsh_geometry(cache: DecodeCache, step: StepInputs, att: LSHSelfAttention, meta: Tensor, all_hashed: bool,
                  index: LSHIndex | None) -> None:
    assert index is not None
    b, heads, rounds, device = meta.shape[0], att.heads, att.rounds, meta.device
    t = step.t
    step.geo = WindowGeometry(t, meta[:, Meta.LSH_CHUNKS], heads, rounds, att.chunk, att.before, att.after)
    index_slot = meta[:, Meta.INDEX_SLOT].view(b, 1)
    step.base = ((index_slot * heads + torch.arange(heads, device=device)).view(b, heads, 1) * rounds
                 + torch.arange(rounds, device=device))
    step.value = index.store(t).view(b, 1).expand(b, heads * rounds).reshape(-1)
    step.weight = meta[:, Meta.KEEPS_INDEX].to(torch.int16).view(b, 1).expand(b, heads * rounds).reshape(-1)
    if not all_hashed:
        # rows still shorter than a chunk attend densely over every position, in round 0 of the same layout
        w = (att.before + 1 + att.after) * att.chunk
        dense_pos = torch.arange(w, device=device).view(1, 1, 1, w)
        round0 = torch.arange(rounds, device=device).view(1, 1, -1, 1) == 0
        dense_absent = (dense_pos > t.view(b, 1, 1, 1)) | ~round0
        step.dense = (meta[:, Meta.HASHED].bool().view(b, 1, 1, 1), dense_pos.masked_fill(dense_absent, 0),
                      dense_absent,
                      round0)



def _lsh_attend(cache: DecodeCache, li: int, att: LSHSelfAttention, qk: Tensor, step: StepInputs) -> Tensor:
    b, heads, d = qk.shape
    rounds = att.rounds
    index = cache.indexes[li]
    assert index is not None
    # hash the new query of every row that keeps an index, one call per bucket count in the batch
    hash_rows = step.backends.linears.hash
    if len(step.groups) == 1 and step.groups[0][1] is None:  # every row hashes with one bucket count
        buckets = hash_rows(att, qk, step.groups[0][0])  # (B, H, R)
    else:
        buckets = torch.zeros(b, heads, rounds, dtype=torch.long, device=qk.device)
        for nb, sel in step.groups:
            buckets[sel] = hash_rows(att, qk[sel], nb)
    kernel = step.backends.window
    if kernel is not None:
        # two C calls: the insert into the recent order; the windows' positions from the index and the
        # attention over them (model/kernels/)
        norms_pool = cache.norms[li]
        assert norms_pool is not None and step.meta is not None
        buckets = buckets.contiguous()
        arrays = index.arrays()
        kernel.append(arrays, step.meta, buckets)
        return kernel.lsh_attend(
            qk.contiguous(), cache.keys[li].view(-1, d), norms_pool.view(-1), cache.values[li].view(-1, d),
            step.meta, buckets, arrays, cache.block_table, cache.block_size, cache.scratch_slot, att.chunk,
            att.before, att.after, self_mask_value(torch.float32), mask_value(torch.float32), att.successor_heads,
            order_table=cache.order_table)
    assert step.geo is not None and step.base is not None and step.value is not None and step.weight is not None
    counts = index.append(step.base, buckets, step.value, step.weight)
    pos, absent = index.window(step.base, counts, buckets, step.geo, step.orders)  # (B, H, R, W)
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
    # masks replace logits, as in the reference: padding never counts, the query's own position gets -1e5;
    # successor-value heads never attend their own position (model/lsh/successor.py): the padding mask there
    own = pos == step.t.view(b, 1, 1, 1)  # (B, H, R, W)
    dots = dots.masked_fill(own, self_mask_value(dots.dtype))
    successor = att.successor_heads
    if successor:
        dots[:, :successor] = dots[:, :successor].masked_fill(own[:, :successor], mask_value(dots.dtype))
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
    out = cache.weighted_values(li, flat.view(b, heads, rounds * w), probs)  # (B, H, D) float32
    if successor:
        # a successor-value head with nothing but its own position to attend outputs exactly 0
        seen = (lse[:, :successor] >= no_key_threshold(torch.float32)).any(dim=2)  # (B, k, 1)
        out[:, :successor] = torch.where(seen, out[:, :successor], torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(qk.dtype)
