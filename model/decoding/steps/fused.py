"""A CPU decode step's layers in one C call (model/kernels/csrc/step_layers.c): the token and position embeddings,
every layer's layer norm, projections, cache write, LSH hash and insert, attention and tail, then the final
layer norm and the LM head.

model/decoding/step.py's step calls the same C functions one by one from Python, about ten calls with their views
and argument checks per layer; on the shipped model that Python was about half of a step. Here the step
builds one array describing every layer (the packed weights `StepLinears` keeps, the cache's pools and LSH
index tensors, the window geometry; remade only when a weight, an index tensor or the step's bucket counts
change) and makes one call. On more than one intra-op thread the call splits the products by column panels
and the attention by (row, head) between OpenMP threads; each value is computed as on one thread, so the
bits do not depend on the thread count (nor, each row being computed alone, on the batch).

It runs for a float32 CPU cache with the window kernel, known activations and one-dimensional layer norms;
elsewhere `run` returns None and the per-layer path runs. Rows hashing with different bucket counts
(automatic counts follow each row's length) are hashed one by one in C, as the per-layer path hashes each
count's rows together (each row's hash is computed alone either way). The results are the per-layer kernel
path's on one thread, bit for bit (tests/model/test_step_fused.py).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ...attention import LSHSelfAttention
from ...chunking import mask_value, self_mask_value
from ...embeddings import AxialPositionEmbeddings, PositionEmbeddings
from ...kernels import CpuKernels, abi
from ...kernels.bindings import KIND, check_status, pool_stride
from ..plan import layer_plan
from .linear import StepLinears, act_code, norm_params, parameter_stamp

if TYPE_CHECKING:
    from ...reformer import ReformerLM
    from ..cache import DecodeCache

def _table(t: Tensor | None, rows: int, cols: int) -> int | None:
    """The pointer of a float32 contiguous table of `rows` x `cols` elements, or None."""
    if t is None or t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != rows * cols:
        return None
    return t.data_ptr()


def _embedding_words(lm: ReformerLM, hidden: int) -> list[int] | None:
    """StepEmbedding for the model's token and position embeddings, or None for ones the C side does not
    compute (in training mode their dropout would apply)."""
    emb = lm.embeddings
    word_table = emb.word_embeddings.weight
    word = _table(word_table, word_table.shape[0], hidden)
    pos = emb.position_embeddings
    if word is None or (emb.training and emb.dropout > 0):
        return None
    if isinstance(pos, AxialPositionEmbeddings):
        (s0, s1), first, second = pos.shape, pos.weights[0], pos.weights[1]
        d0, d1 = first.shape[-1], second.shape[-1]
        ptrs = _table(first, s0, d0), _table(second, s1, d1)
        if ptrs[0] is None or ptrs[1] is None or d0 + d1 != hidden:
            return None
        return [word, word_table.shape[0], ptrs[0], s0, d0, ptrs[1], s1, d1]
    if isinstance(pos, PositionEmbeddings):
        table = pos.embedding.weight
        ptr = _table(table, table.shape[0], hidden)
        return None if ptr is None else [word, word_table.shape[0], ptr, table.shape[0], hidden, 0, 1, 0]
    return None


class _Described:
    """What the C side reads for one model, cache and set of bucket counts, made when `_stamp` changes."""

    def __init__(self, stamp: tuple[object, ...], lm: ReformerLM, modules: list[nn.Module]) -> None:
        self.stamp = stamp
        self.model = lm  # held: the stamp's id(lm) cannot be another model's while this exists
        self.modules = modules  # the model's modules that hold parameters (what `_stamp` reads)
        self.packings: list[object] = []  # held: the packed weights the layer array points into
        self.layers: ctypes.Array[abi.StepLayer] | None = None
        self.floats: ctypes.Array[ctypes.c_float] | None = None
        self.hashes: ctypes.Array[ctypes.c_int64] | None = None
        self.embedding: ctypes.Array[abi.StepEmbedding] | None = None
        self.hidden = self.count = self.vocab = 0
        self.final: tuple[int, int] = (0, 0)
        self.final_eps = 0.0
        self.head: tuple[int, int] = (0, 0)


def _stamp(lm: ReformerLM, modules: list[nn.Module], cache: DecodeCache, counts: tuple[str, ...]
           ) -> tuple[object, ...]:
    """What the described arrays depend on: the model, every parameter's storage and version counter (a
    weight replaced or edited in place is packed again), the LSH indexes' count tensors (they are replaced
    when an automatic bucket count grows) and the step's bucket counts. `modules`: the model's modules that
    hold parameters (read from `_parameters`: walking `lm.parameters()` is most of a small step's stamp)."""
    out: list[object] = [id(lm), counts, *parameter_stamp(modules)]
    for index in cache.indexes:
        if index is not None:
            out += (index.main_counts.data_ptr(), index.recent_counts.data_ptr())
    return tuple(out)


class FusedStep:
    """`run(lm, cache, tokens, meta, groups)`: the step's logits, or None where the one-call path does not
    apply."""

    def __init__(self, linears: StepLinears) -> None:
        self.linears = linears
        self._factors: dict[str, Tensor] = {}  # bucket count -> its factors as the C side reads them
        self._described: _Described | None = None  # the last step's arrays, reused while `_stamp` is the same
        self._buffers: dict[tuple[int, int], tuple[ctypes.Array[ctypes.c_float], ctypes.Array[ctypes.c_float]]] = {}

    def run(self, lm: ReformerLM, cache: DecodeCache, window: CpuKernels | None, tokens: Sequence[int],
            meta: Sequence[Sequence[int]], groups: list[tuple[int | list[int], list[int] | None]]) -> Tensor | None:
        """tokens (B ints) the step's tokens, meta (B rows of 7 ints) its rows' facts (model/decoding/facts.py
        `row_facts`); `groups` the rows by bucket count (`bucket_groups`); `window`: the step's C window
        functions (None: the windows are PyTorch's, and so is this step). Host inputs: the C side reads them
        from ctypes arrays, with no tensor made for them. Returns the logits (B, vocab) float32, the cache
        updated as the per-layer path updates it, or None (nothing done)."""
        kernel = self.linears.kernel
        held = self.described(lm, cache, window, groups)
        if held is None or kernel is None:
            return None
        rows, hidden = len(tokens), held.hidden
        if len(meta) != rows or any(len(m) != abi.META_COLUMNS for m in meta):
            raise ValueError(f"fused step: {len(meta)} rows of facts for {rows} tokens (each {abi.META_COLUMNS} words)")
        # each row's bucket-count group (-1: it hashes with none)
        group_of = [0 if groups and groups[0][1] is None else -1] * rows
        for g, (_, members) in enumerate(groups):
            for r in members or ():
                group_of[r] = g
        x1, x2 = self._scratch(rows, hidden)  # the C side fills both; nothing reads them after the call
        logits = torch.empty(rows, held.vocab, dtype=torch.float32)
        table = cache.block_table
        status = kernel.layers_raw(rows, hidden, held.count, held.layers, held.floats, len(groups),
                                   (ctypes.c_int64 * rows)(*group_of), held.hashes, held.embedding,
                                   (ctypes.c_int64 * rows)(*tokens), x1, x2,
                                   (ctypes.c_int64 * (rows * abi.META_COLUMNS))(*itertools.chain.from_iterable(meta)),
                                   table.data_ptr(), table.shape[1], table.shape[0], cache.block_size,
                                   cache.scratch_slot, *held.final, held.final_eps, *held.head, held.vocab,
                                   logits.data_ptr(), torch.get_num_threads(), self.linears.weights_code)
        check_status(status, "decode step kernel")
        return logits

    def described(self, lm: ReformerLM, cache: DecodeCache, window: CpuKernels | None,
                  groups: list[tuple[int | list[int], list[int] | None]]) -> _Described | None:
        """What the C side reads for this model, cache and bucket counts (made again when `_stamp` changes), or
        None where the one-call path does not apply (model/decoding/steps/fused_extend.py reads it too)."""
        kernel = self.linears.kernel
        if kernel is None or window is None or cache.device.type != "cpu" or cache.dtype != torch.float32:
            return None
        counts = tuple(str(nb) for nb, _ in groups)
        held = self._described
        modules = held.modules if held is not None and held.model is lm else [m for m in lm.modules() if m._parameters]
        stamp = _stamp(lm, modules, cache, counts)
        if held is None or held.stamp != stamp:
            held = self._described = self._describe(lm, cache, [nb for nb, _ in groups], stamp, modules)
        return None if held.layers is None else held

    def _scratch(self, rows: int, hidden: int) -> tuple[ctypes.Array[ctypes.c_float], ctypes.Array[ctypes.c_float]]:
        """The two hidden-state buffers of a step of `rows` rows, made once per size and reused."""
        key = (rows, hidden)
        held = self._buffers.get(key)
        if held is None:
            held = self._buffers[key] = ((ctypes.c_float * (rows * hidden))(), (ctypes.c_float * (rows * hidden))())
        return held

    def _describe(self, lm: ReformerLM, cache: DecodeCache, counts: list[int | list[int]],
                  stamp: tuple[object, ...], modules: list[nn.Module]) -> _Described:
        """The arrays the C side reads for this model, cache and bucket counts (`layers` None: it cannot run)."""
        linears, kernel = self.linears, self.linears.kernel
        assert kernel is not None
        held = _Described(stamp, lm, modules)
        factors = [self._factor_tensor(nb) for nb in counts]
        hashes: list[int] = []
        layers: list[dict[str, int]] = []
        floats: list[float] = []
        self_mask, mask = self_mask_value(torch.float32), mask_value(torch.float32)
        hidden = lm.config.hidden_size
        for li, p in enumerate(layer_plan(lm)):
            att = p.attention
            keys, values = cache.keys[li], cache.values[li]
            norm, ff_norm = norm_params(p.norm), norm_params(p.ff_norm)
            act = act_code(p.ff_act)
            if norm is None or ff_norm is None or act is None or keys.dtype not in kernel.reads:
                return held
            proj = linears.packing(p.projections)
            out, dense, down = (linears.packing((layer,)) for layer in (p.output, p.ff_dense, p.ff_output))
            held.packings += [proj, out, dense, down]
            width = att.heads * att.head_size
            if (proj.k != hidden or proj.n != len(p.projections) * width or out.k != width or out.n != hidden
                    or dense.k != hidden or down.k != dense.n or down.n != hidden):
                raise ValueError(f"fused step: layer {li}'s weights do not fit hidden size {hidden}")
            f: dict[str, int] = {}
            f.update(order_table=cache.order_table.data_ptr(), heads=att.heads, dim=att.head_size,
                     kind=KIND[keys.dtype], pool_rows=keys.shape[0],
                     stride=pool_stride("fused step", keys, values),
                     ln_w=norm[0], ln_b=norm[1], proj_w=proj.weight_ptr, proj_b=proj.bias_ptr, keys=keys.data_ptr(),
                     values=values.data_ptr(), chunk=att.chunk, before=att.before, ff=dense.n, act=act,
                     w_out=out.weight_ptr, b_out=out.bias_ptr, ff_ln_w=ff_norm[0], ff_ln_b=ff_norm[1],
                     w_dense=dense.weight_ptr, b_dense=dense.bias_ptr, w_ff=down.weight_ptr, b_ff=down.bias_ptr)
            if isinstance(att, LSHSelfAttention):
                index, norms = cache.indexes[li], cache.norms[li]
                if att.rounds > abi.MAX_ROUNDS or index is None or norms is None:
                    return held
                items = index.items
                f.update(lsh=1, norms=norms.data_ptr(), rounds=att.rounds, after=att.after, buckets=index.buckets,
                         successor=att.successor_heads,
                         recent_size=index.recent_size, items_len=items.numel(), item_bytes=items.element_size(),
                         shift=index.shift, recent_offset=index.recent_offset,
                         main_counts=index.main_counts.data_ptr(), recent_counts=index.recent_counts.data_ptr(),
                         items=items.data_ptr())
                for fs in factors:
                    size = int(fs.sum())  # the rotations' size: the count, or its factors' sum
                    hashes += [linears.rotations(att, size).data_ptr(), size // 2, fs.numel(), fs.data_ptr()]
            else:
                f.update(ring=cache.ring.width)  # its pools are rings of its window (model/decoding/local_ring.py)
                hashes += [0] * (4 * len(factors))
            layers.append(f)
            floats += [p.norm.eps, p.ff_norm.eps, self_mask, mask]
        final = norm_params(lm.final_layer_norm)
        if final is None or not isinstance(lm.lm_head, nn.Linear):
            return held
        head = linears.packing((lm.lm_head,))
        if head.k != 2 * hidden:
            raise ValueError(f"fused step: an LM head of {head.k} inputs for hidden size {hidden}")
        held.packings.append(head)
        held.hidden, held.count, held.vocab = hidden, len(floats) // 4, head.n
        held.final, held.final_eps, held.head = final, lm.final_layer_norm.eps, (head.weight_ptr, head.bias_ptr)
        embedding = _embedding_words(lm, hidden)
        if embedding is None:
            return held
        held.embedding = (abi.StepEmbedding * 1)(abi.StepEmbedding(*embedding))
        held.floats = (ctypes.c_float * len(floats))(*floats)
        held.hashes = (ctypes.c_int64 * max(len(hashes), 1))(*hashes)
        held.layers = (abi.StepLayer * len(layers))(*(abi.StepLayer(**f) for f in layers))
        return held

    def _factor_tensor(self, nb: int | list[int]) -> Tensor:
        key = str(nb)
        held = self._factors.get(key)
        if held is None:
            held = self._factors[key] = torch.tensor([nb] if isinstance(nb, int) else list(nb), dtype=torch.int64)
        return held


__all__ = ["FusedStep"]
