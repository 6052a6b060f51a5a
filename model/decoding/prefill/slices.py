"""A layer's attention in bounded slices, for chunked prefill: the same bits as the full forward.

A long prompt's prefill runs between decode steps (model/decoding/prefill/ `prefill_steps`), so no unit of its work
may take much longer than a decode step. A layer's attention over a 60K-token prompt is one such unit in the
full forward (`ReformerLayer.f`); here it is cut up without changing what it computes:

- the projections, the LSH hashing and the output projection compute each position alone: they run in
  blocks of positions (model/decoding/prefill/row_blocks.py, with the bits of one call over the prompt), a
  `yield` between blocks; the bucket sort (every hash round's (bucket, position) order) sees the whole
  prompt at once, as in the full forward (a counting sort in C, model/decoding/lsh_index.py);
- the chunk windows are attended `slice_chunks` window attentions (row x head x chunk) at a time, with a
  `yield` after each slice. A chunk's window attention depends only on its own queries and its window's keys,
  so computing the chunks in groups changes nothing: the window kernel runs on the same rows with the same
  keys in the same order. An LSH slice gathers just its own windows' rows (model/decoding/prefill/lsh_windows.py);
- LSH rounds are combined in slices of positions once every chunk of a head group is done
  (model/decoding/prefill/lsh_windows.py).

Exactness: the result is bit-identical (`torch.equal`) to `layer.f(x2, ctx, None)[0]` in eval mode: the same
kernels on the same rows. tests/model/test_prefill_slices.py checks it with `torch.equal` on CPU for the fused
window kernel and the plain softmax, uniform and mixed-length padded batches, and rows shorter than a chunk
(the CUDA kernel's path is the same code, untested here). Training (dropout,
autograd) is not sliced: `layer_f_slices` then runs `layer.f` in one piece.

A prefill's last layer asks for its output at each prompt's last position only (`only`): an LSH layer then
attends just the chunks holding that position (one per head and round), bit-identical on the C kernel to the
whole attention picked there (tests/model/test_prefill_slices.py).

The primitives are the attention modules' own (model/attention.py, model/chunking.py, model/fused_attention.py);
the loops mirror `LSHSelfAttention._chunked` and `LocalSelfAttention._chunked` with the chunk axis cut.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...attention import (
    AttentionContext,
    LocalSelfAttention,
    LSHSelfAttention,
    merge_heads,
    split_heads,
)
from ...fused_attention import local_window_attend
from ...lsh.successor import successor_values
from ...lsh.windows import window_chunk_index
from .lsh_windows import lsh_chunked
from .row_blocks import Blocks, in_blocks, rows_in_blocks

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...reversible import ReformerLayer

# Window attentions (one batch row, one head, one chunk of queries against its window) per slice. With the
# default model (chunk 64, head size 32, windows of 2 chunks) one is ~1 MFLOP plus the bias and the gathers;
# 256 of them take roughly 20-40 ms on a 2-core CPU (bench/prefill/prefill_gap.py measures the gaps they leave).
DEFAULT_SLICE_CHUNKS = 256

Slices = Generator[None, None, Tensor]
if TYPE_CHECKING:
    _Dense = Callable[[Tensor, AttentionContext], Tensor]
    _Chunked = Callable[[Tensor | None, AttentionContext], Slices]


@dataclass
class Projections:
    """What a layer's attention computes from its input before attending, (B, H, L, D) each: `key` is what the
    decode cache keeps as keys (LSH: the shared query/key projection; local: the key divided by sqrt(head
    size)), `value` what it keeps as values (an LSH layer's successor-value heads: the next position's value,
    0 at each row's last position, model/lsh/successor.py), `query` the local layers' query, `buckets`
    (B, H, R, L) an LSH layer's hash of a batch longer than a chunk (None otherwise: such a batch attends
    densely)."""

    key: Tensor
    value: Tensor
    query: Tensor | None = None
    buckets: Tensor | None = None


def projections(att: LSHSelfAttention | LocalSelfAttention, x: Tensor, ctx: AttentionContext
                ) -> Generator[None, None, Projections]:
    """The projections (and an LSH layer's hashing) of `attention_slices`, with its yields: a prefill computes
    them once for the cache and the attention (model/decoding/prefill/). Each runs in blocks of positions
    (model/decoding/prefill/row_blocks.py), yielding between them: the same bits as one call over the prompt."""
    long = x.shape[1] > att.chunk  # else one dense piece: nothing to slice

    def project(linear: torch.nn.Module, scale: float = 1.0) -> Blocks:
        def scaled(rows: Tensor) -> Tensor:
            out = linear(rows)
            return out if scale == 1.0 else out / scale  # elementwise: the same bits as the whole product's

        return split_heads((yield from rows_in_blocks(scaled, x)), att.heads, att.head_size)  # (B, H, L, D)

    if isinstance(att, LSHSelfAttention):
        qk = yield from project(att.query_key)
        if long:
            yield  # each projection of a long prompt is a large matmul: a piece (or pieces) of its own
        v = successor_values((yield from project(att.value)), att.successor_heads, ctx.valid)  # (B, H, L, D)
        if not long:
            return Projections(qk, v)
        yield
        # the whole prompt's buckets, as the forward hashes them, in blocks of positions (each position's
        # rotations and argmax are its own)
        buckets = yield from in_blocks(lambda a, z: att._hash_rows(qk[:, :, a:z], _positions(ctx, a, z)),
                                       x.shape[0], x.shape[1], x.device, dim=3)
        yield
        return Projections(qk, v, buckets=buckets)
    if isinstance(att, LocalSelfAttention):
        q = yield from project(att.query)
        if long:
            yield
        k = yield from project(att.key, math.sqrt(att.head_size))
        if long:
            yield
        v = yield from project(att.value)
        if long:
            yield
        return Projections(k, v, query=q)
    raise TypeError(f"no sliced attention for {type(att).__name__}")


def _positions(ctx: AttentionContext, a: int, z: int) -> AttentionContext:
    """The context of positions a..z-1 of every row: their padding mask; each row's own length (what an
    automatic bucket count is chosen by) unchanged."""
    valid = None if ctx.valid is None else ctx.valid[:, a:z]
    return AttentionContext(valid=valid, own_length=ctx.own_length, generator=ctx.generator)


def layer_f_slices(layer: ReformerLayer, x2: Tensor, ctx: AttentionContext,
                   slice_chunks: int = DEFAULT_SLICE_CHUNKS, given: Projections | None = None,
                   only: Tensor | None = None) -> Slices:
    """`layer.f(x2, ctx, None)[0]` (eval) in slices: yields after each projection, the hashing and the sort,
    each `slice_chunks` window attentions, and before the output projection. `given`: the attention's
    `projections` of `layer.attention.layer_norm(x2)`, already computed. Returns (B, L, hidden), or with
    `only` (B,) positions, (B, 1, hidden): row b's output at position only[b] alone (the last layer of a
    prefill needs no other; see `attention_slices`)."""
    block = layer.attention
    if layer.training or torch.is_grad_enabled():
        out = layer.f(x2, ctx, None)[0]  # dropout masks and autograd want the forward's own layout
        return out if only is None else at_positions(out, only)
    x = None if given is not None else (yield from rows_in_blocks(block.layer_norm, x2))
    h = yield from attention_slices(block.self_attention, x, ctx, slice_chunks, given, only)
    if only is not None:
        return block.output(h)  # type: ignore[no-any-return]
    yield  # the output projection, a (L, H*D) x (H*D, hidden) matmul, in pieces of its own: blocks of positions
    return (yield from rows_in_blocks(block.output, h))


def at_positions(x: Tensor, positions: Tensor) -> Tensor:
    """Row b's position positions[b] of x (B, L, F) -> (B, 1, F)."""
    return x[torch.arange(x.shape[0], device=x.device), positions].unsqueeze(1)


def attention_slices(att: torch.nn.Module, x: Tensor | None, ctx: AttentionContext,
                     slice_chunks: int = DEFAULT_SLICE_CHUNKS, given: Projections | None = None,
                     only: Tensor | None = None) -> Slices:
    """`att(x, ctx)[0]` for an eval LSHSelfAttention or LocalSelfAttention, in slices, from `x` or from its
    `projections` already computed (`given`). Returns (B, L, H*D), or with `only` (B,) positions (B, 1, H*D):
    row b's output at only[b]. An LSH layer over rows longer than a chunk then attends only the chunks that
    hold those positions (one per head and round) and combines their rounds; otherwise every chunk is
    attended and the positions picked."""
    if slice_chunks < 1:
        raise ValueError("slice_chunks must be at least 1")
    if not isinstance(att, LSHSelfAttention | LocalSelfAttention):
        raise TypeError(f"no sliced attention for {type(att).__name__}")
    if given is None:
        assert x is not None
        given = yield from projections(att, x, ctx)
    if isinstance(att, LSHSelfAttention):
        if only is not None and given.buckets is not None and bool((ctx.own_length > att.chunk).all()):
            out = yield from lsh_chunked(att, given.key, given.value, given.buckets, ctx, slice_chunks, only)
            return merge_heads(out)  # (B, 1, H*D)
        out = yield from _lsh_slices(att, given, ctx, slice_chunks)
    else:
        out = yield from _local_slices(att, given, ctx, slice_chunks)
    return out if only is None else at_positions(out, only)


def _lsh_slices(att: LSHSelfAttention, given: Projections, ctx: AttentionContext, slice_chunks: int) -> Slices:
    qk, v, buckets = given.key, given.value, given.buckets
    if buckets is None:  # no longer than a chunk: one dense piece
        return merge_heads(att._dense(qk, v, ctx))
    c = att.chunk

    def dense(rows: Tensor, sub: AttentionContext) -> Tensor:
        return att._dense(qk[rows, :, :c], v[rows, :, :c], sub)

    def chunked(rows: Tensor | None, sub: AttentionContext) -> Slices:
        if rows is None:
            return (yield from lsh_chunked(att, qk, v, buckets, sub, slice_chunks))
        return (yield from lsh_chunked(att, qk[rows], v[rows], buckets[rows], sub, slice_chunks))

    out = yield from _split_short_rows(v, ctx, c, dense, chunked)
    return merge_heads(out)


def _local_slices(att: LocalSelfAttention, given: Projections, ctx: AttentionContext, slice_chunks: int) -> Slices:
    q, k, v = given.query, given.key, given.value
    assert q is not None
    if k.shape[2] <= att.chunk:  # one dense piece: nothing to slice
        return merge_heads(att._dense(q, k, v, ctx))
    c = att.chunk

    def dense(rows: Tensor, sub: AttentionContext) -> Tensor:
        return att._dense(q[rows, :, :c], k[rows, :, :c], v[rows, :, :c], sub)

    def chunked(rows: Tensor | None, sub: AttentionContext) -> Slices:
        if rows is None:
            return (yield from _local_chunked(att, q, k, v, sub, slice_chunks))
        return (yield from _local_chunked(att, q[rows], k[rows], v[rows], sub, slice_chunks))

    out = yield from _split_short_rows(v, ctx, c, dense, chunked)
    return merge_heads(out)


def _split_short_rows(v: Tensor, ctx: AttentionContext, chunk: int, dense: _Dense, chunked: _Chunked) -> Slices:
    """attention.split_short_rows with a sliced `chunked`: rows whose own length fits in one chunk attend
    densely (one small piece), the others chunked; the same row subsets as the forward, so the same bits."""
    short = ctx.own_length <= chunk
    if not bool(short.any()):
        return (yield from chunked(None, ctx))
    out = torch.zeros_like(v)
    rows_short = short.nonzero().squeeze(1)
    out[rows_short, :, :chunk] = dense(rows_short, _subset(ctx, rows_short, chunk))
    if not bool(short.all()):
        rows_long = (~short).nonzero().squeeze(1)
        out[rows_long] = yield from chunked(rows_long, _subset(ctx, rows_long, None))
    return out


def _subset(ctx: AttentionContext, rows: Tensor, length: int | None) -> AttentionContext:
    valid = None if ctx.valid is None else ctx.valid[rows][:, :length]
    return AttentionContext(valid=valid, own_length=ctx.own_length[rows], generator=ctx.generator)


def _window_rows(x: Tensor, win: Tensor, n: int) -> Tensor:
    """Chunks `win` (B, S, W) of x (B, N*C, *rest) -> (B, S, W*C, *rest): chunking.gather_chunks for a
    slice of the chunk axis (gather_chunks wants the index of every chunk). Same values, gathered."""
    b, s, w = win.shape
    c = x.shape[1] // n
    rest = x.shape[2:]
    flat = x.reshape(b * n, c, *rest)
    base = torch.arange(b, device=x.device).view(b, 1, 1) * n
    return flat[(win + base).reshape(-1)].reshape(b, s, w * c, *rest)


def _local_chunked(att: LocalSelfAttention, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext,
                   slice_chunks: int) -> Slices:
    """LocalSelfAttention._chunked (eval) with its chunk axis cut into slices. (B, H, L, D) -> (B, H, L, D)."""
    b, heads, t, d = q.shape
    pos = torch.arange(t, device=q.device)
    c, n = att.chunk, t // att.chunk
    own_chunks = torch.clamp((ctx.own_length + c - 1) // c, min=1)
    win = window_chunk_index(own_chunks, 1, n, att.before, att.after)  # (B, N, W)
    q_c = q.view(b, heads, n, c, d)
    # (B, L, H, D): rows of every head together, as gather_chunks picks them; contiguous once here, not
    # copied by a reshape in every slice
    k_t = k.transpose(1, 2).contiguous()
    v_t = v.transpose(1, 2).contiguous()
    qp_all = pos.view(1, 1, n, c).expand(b, 1, n, c)
    step = max(1, slice_chunks // (b * heads))  # chunks per slice, every batch row and head
    # (B, L, H, D): each slice's output copied into its positions as it is computed, laid out as merge_heads
    # wants it (a view then, no copy). Concatenating the slices and merging the heads at the end were two
    # whole-prompt copies in one piece: 0.09 s at 131K tokens of 2 x 64 heads, beyond the budget at 500K
    out: Tensor | None = None
    for j0 in range(0, n, step):
        j1 = min(j0 + step, n)
        w_s = win[:, j0:j1]
        s = j1 - j0
        k_w = _window_rows(k_t, w_s, n).view(b, s, -1, heads, d).permute(0, 3, 1, 2, 4)  # (B, H, S, W*C, D)
        v_w = _window_rows(v_t, w_s, n).view(b, s, -1, heads, d).permute(0, 3, 1, 2, 4)
        qp = qp_all[:, :, j0:j1]  # (B, 1, S, C)
        kp = _window_rows(pos.expand(b, t), w_s, n).unsqueeze(1)  # (B, 1, S, W*C)
        kv = None if ctx.valid is None else torch.gather(ctx.valid[:, None, None, :].expand(b, 1, s, t), 3, kp)
        o = local_window_attend(q_c[:, :, j0:j1], k_w.reshape(b, heads, s, -1, d), v_w.reshape(b, heads, s, -1, d),
                                qp, kp, kv, att.causal, 0.0, ctx.generator, att.fused, att.c_kernel)
        if out is None:
            out = torch.empty(b, t, heads, d, dtype=o.dtype, device=o.device)
        out[:, j0 * c : j1 * c] = o.reshape(b, heads, s * c, d).transpose(1, 2)  # (B, H, S, C, D) -> (B, S*C, H, D)
        yield
    assert out is not None  # n >= 1: the loop ran
    return out.transpose(1, 2)  # (B, H, L, D)
