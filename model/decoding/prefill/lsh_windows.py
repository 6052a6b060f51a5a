"""An LSH layer's chunk windows for chunked prefill (model/decoding/prefill/slices.py), in slices of bounded work.

`LSHSelfAttention._chunked` (eval) sorts each head's rows by bucket, gathers every round's sorted rows, attends
each chunk of the sorted order to its window (itself and the chunks before it) and combines the rounds per
position. Here nothing in a slice grows with the prompt but the whole-prompt sort:

- a slice gathers only its own chunks' windows from the unsorted rows (an index_select of their query-key
  and value rows) and normalises those keys;
- the rounds are combined in slices of positions once every chunk of the head group is attended: each
  position's output of every round is gathered back (its place in each round's order) and weighted.

The kernels see the same rows, positions and masks in the same order as in the forward, and the rounds are
added in the same order from zero, so the output has the forward's bits on the C chunk kernel (which computes
each (row, head, chunk) alone): tests/model/test_prefill_slices.py compares with `torch.equal`.
"""

from __future__ import annotations

import math
from collections.abc import Generator

import torch
from torch import Tensor

from ...attention import AttentionContext, LSHSelfAttention, length_normalize
from ...chunking import attend, fusable, round_weights
from ...fused_attention import FusedKernel, fused_lsh_attend, native_kernels, window_kernel_for
from ...lsh.masks import attention_bias
from ...lsh.order import bucket_order
from ...lsh.successor import zero_rows_without_keys
from ...lsh.windows import window_chunk_index

Slices = Generator[None, None, Tensor]


def lsh_chunked(att: LSHSelfAttention, qk: Tensor, v: Tensor, buckets: Tensor, ctx: AttentionContext,
                slice_chunks: int, only: Tensor | None = None) -> Slices:
    """(B, H, L, D) -> (B, H, L, D), yielding between slices of at most `slice_chunks` window attentions (row x
    head x chunk); heads go in groups of as many as one slice holds (every head of a short prompt, one of a
    long one), so a short prompt makes one kernel call per layer. With `only` (B,) positions: (B, H, 1, D), row
    b's output at only[b], from the one chunk per head and round that holds it (a prefill's last layer)."""
    b, h, t, d = qk.shape
    r, c = att.rounds, att.chunk
    n = t // c
    device = qk.device
    s = att.successor_heads  # heads 0..s-1 mask and combine as successor-value heads (model/lsh/successor.py)
    # the whole prompt's sort, in C on the CPU (a 60K prompt's argsort took 37-230 ms)
    order = bucket_order(buckets, None, native_kernels(qk) if att.c_kernel else None)  # (B, H, R, L)
    own_chunks = torch.clamp((ctx.own_length + c - 1) // c, min=1)
    win = window_chunk_index(own_chunks, r, n, att.before, att.after)  # (B, R*N, W): chunks on the R*N axis
    kernel = window_kernel_for(qk, fusable(0.0, att.fused))
    # each (row, position, head)'s query-key and value rows: views when qk and v are laid out (B, L, H, D) as
    # the projections produce them (model/attention.py split_heads), a copy of the prompt's rows otherwise
    rows = (qk.transpose(1, 2).contiguous().view(-1, d), v.transpose(1, 2).contiguous().view(-1, d))
    g = max(1, min(h, slice_chunks // (b * r * n)))
    step = max(1, slice_chunks // (b * g))  # chunks of the group's heads per slice, every batch row
    if only is not None:
        out = torch.zeros(b, h, 1, d, dtype=qk.dtype, device=device)
        # where only[b] sits in each round's sorted order: its chunk on the R*N axis and its row in it
        rank = (order == only.view(b, 1, 1, 1)).to(torch.int32).argmax(dim=-1)  # (B, H, R)
        chunk_at = torch.arange(r, device=device).view(1, 1, r) * n + torch.div(rank, c, rounding_mode="floor")
        row_at = torch.remainder(rank, c).to(torch.int64)
    else:
        out = torch.zeros_like(qk)
    yield
    batch = torch.arange(b, device=device).view(b, 1, 1)
    # groups of at most g heads, none holding both successor and plain heads
    starts = sorted({*range(0, h, g), *([s] if 0 < s < h else [])})
    for i0, i1 in zip(starts, [*starts[1:], h]):
        successor = i0 < s
        sorted_chunks = order[:, i0:i1].reshape(b, i1 - i0, r * n, c)  # (B, g, R*N, C) positions
        if only is not None:
            chunks = win[batch, chunk_at[:, i0:i1]]  # (B, g, R, W)
            o, lse = _attend_windows(att, kernel, rows, sorted_chunks, chunks, i0, h, ctx, successor)
            out[:, i0:i1, 0] = _combine_rows(o.gather(3, row_at[:, i0:i1, :, None, None].expand(-1, -1, -1, 1, d))
                                             .squeeze(3), lse.gather(3, row_at[:, i0:i1, :, None]).squeeze(3),
                                             successor)
            yield
            continue
        # every chunk's output (B, g, R*N, C, D) and log-sum-exp (B, g, R*N, C), each slice's copied in as it is
        # computed: concatenating the slices after the last one was a whole-prompt copy in one piece
        outs: Tensor | None = None
        lses: Tensor | None = None
        for j0 in range(0, r * n, step):
            o, lse = _attend_windows(att, kernel, rows, sorted_chunks, win[:, None, j0:j0 + step], i0, h, ctx,
                                     successor)
            if outs is None or lses is None:
                outs = torch.empty(b, i1 - i0, r * n, c, d, dtype=o.dtype, device=device)
                lses = torch.empty(b, i1 - i0, r * n, c, dtype=lse.dtype, device=device)
            outs[:, :, j0 : j0 + step] = o
            lses[:, :, j0 : j0 + step] = lse
            yield
        assert outs is not None and lses is not None  # r * n >= 1: the loop ran
        # the rounds combined in slices of as many rows as an attention slice's queries
        yield from _combine_in_slices(out, i0, outs, lses, order[:, i0:i1], max(c, step * c // r), successor)
    return out


def _attend_windows(att: LSHSelfAttention, kernel: FusedKernel | None, rows: tuple[Tensor, Tensor],
                    sorted_chunks: Tensor, chunks: Tensor, i0: int, heads: int, ctx: AttentionContext,
                    successor: bool = False) -> tuple[Tensor, Tensor]:
    """Chunks `chunks` (B, 1|g, S, W) of the sorted order (their windows: W chunk indices each, the chunk
    itself at offset `before`), heads i0.. of the layer's query-key and value `rows` -> output (B, g, S, C, D)
    and log-sum-exp (B, g, S, C), as LSHSelfAttention._chunked computes them for those chunks (`successor`:
    heads i0.. are successor-value heads)."""
    b, g, _, c = sorted_chunks.shape
    s, w = chunks.shape[2], chunks.shape[3]
    d = rows[0].shape[1]
    t = sorted_chunks.shape[2] * c // att.rounds
    bi = torch.arange(b, device=rows[0].device).view(b, 1, 1, 1)
    hi = torch.arange(g, device=rows[0].device).view(1, g, 1, 1)
    pos = sorted_chunks[bi, hi, chunks].reshape(b, g, s, w * c)  # (B, g, S, W*C): the windows' positions
    at = ((bi * t + pos) * heads + i0 + hi).reshape(-1)  # each window slot's row in `rows`
    qk_w, v_w = (x.index_select(0, at).view(b, g, s, w * c, d) for x in rows)
    # the keys as the forward normalises them, row by row (the same bits for a row whatever rows are beside it)
    k_w = length_normalize(qk_w) / math.sqrt(att.head_size)
    own = slice(att.before * c, (att.before + 1) * c)  # the chunk's own rows within its window
    q, q_pos = qk_w[..., own, :], pos[..., own]
    k_valid = None if ctx.valid is None else ctx.valid[bi, pos]
    if kernel is not None:
        return fused_lsh_attend(q, k_w, v_w, v_w[..., own, :], q_pos, pos, k_valid, att.causal, kernel,
                                att.c_kernel, successor=successor)
    bias = attention_bias(q_pos, pos, k_valid, att.causal, not successor, q.dtype, strict=successor)
    return attend(q, k_w, v_w, bias, 0.0, ctx.generator)  # type: ignore[no-any-return]


def _combine_in_slices(out: Tensor, i0: int, o: Tensor, lse: Tensor, order: Tensor, span: int,
                       successor: bool = False) -> Generator[None, None, None]:
    """LSHSelfAttention._combine_rounds in slices of `span` positions, into out[:, i0:i0+g]: o (B, g, R*N, C, D)
    and lse (B, g, R*N, C) in sorted order, order (B, g, R, L) the sorted positions."""
    b, g, r, t = order.shape
    d = o.shape[-1]
    # each position's place in each round's sorted order, as a row of the flattened (B, g, R*L) outputs
    place = torch.empty_like(order).scatter_(3, order, torch.arange(t, device=order.device).expand_as(order))
    place = place + (torch.arange(b * g * r, device=order.device) * t).view(b, g, r, 1)
    o_rows, lse_rows = o.reshape(-1, d), lse.reshape(-1)
    for a in range(0, t, span):
        at = place[..., a : a + span]  # (B, g, R, P)
        p = at.shape[-1]
        picked = o_rows.index_select(0, at.reshape(-1)).view(b, g, r, p, d)
        out[:, i0 : i0 + g, a : a + p] = _combine_rows(picked, lse_rows.index_select(0, at.reshape(-1))
                                                       .view(b, g, r, p), successor)
        yield


def _combine_rows(o: Tensor, lse: Tensor, successor: bool = False) -> Tensor:
    """Every round's output o (B, g, R, [P,] D) and log-sum-exp (B, g, R[, P]) of the same positions -> their
    combination (B, g, [P,] D): each round weighted by its share of the probability mass (round_weights in
    fp32, as LSHSelfAttention._combine_rounds), the rounds added in order from zero as its scatter_add adds them.
    `successor`: a position that saw no key in any round is 0 (model/lsh/successor.py)."""
    weights = round_weights(lse.float(), dim=2).unsqueeze(-1)
    total = torch.zeros_like(o[:, :, 0], dtype=torch.float32)
    for k in range(o.shape[2]):
        total = total + o[:, :, k].float() * weights[:, :, k]
    if not successor:
        return total.to(o.dtype)
    if lse.dim() == 3:  # one position per row: (B, g, 1, D) and (B, g, R, 1)
        return zero_rows_without_keys(total.to(o.dtype).unsqueeze(2), lse.unsqueeze(3), o.shape[1]).squeeze(2)
    return zero_rows_without_keys(total.to(o.dtype), lse, o.shape[1])
