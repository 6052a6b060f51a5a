"""One request's new tokens through every layer in one C call (model/kernels/csrc/extend_layers.c), on the layer
descriptions the one-call step builds (fused.py `FusedStep.described`). The call leaves the logits of its last
row (or, asked, of every row) and the cache as the same tokens fed one decode step each leave them, bit for bit
(tests/model/decoding/test_extend.py); model/decoding/extend.py chooses it and splits long extends."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...kernels import CpuKernels, abi
from ...kernels.bindings import check_status
from .fused import FusedStep

if TYPE_CHECKING:
    from ...reformer import ReformerLM
    from ..cache import DecodeCache


def extend_rows(fused: FusedStep, lm: ReformerLM, cache: DecodeCache, window: CpuKernels | None, tokens: Tensor,
                meta: Tensor, bucket_count: int | list[int], index_len: list[int], all_rows: bool = False
                ) -> Tensor | None:
    """tokens (S,) int64 of one request at consecutive positions, meta (S, abi.META_COLUMNS) int64 their facts
    (model/decoding/facts.py `row_facts`'s columns), both contiguous on the CPU, every row hashing with the fixed
    `bucket_count`; index_len the request's main-order length per layer, updated in place by the merges the call
    makes. Returns the last row's logits (vocab,) float32, or with `all_rows` every row's (S, vocab), each row's
    the bits a decode step at its position returns; None where the one-call path does not apply (nothing
    done)."""
    kernel = fused.linears.kernel
    held = fused.described(lm, cache, window, [(bucket_count, None)])
    if held is None or kernel is None or held.hashes is None:
        return None
    rows, hidden = tokens.shape[0], held.hidden
    if (rows < 1 or tuple(meta.shape) != (rows, abi.META_COLUMNS) or tokens.dtype != torch.int64
            or meta.dtype != torch.int64 or not tokens.is_contiguous() or not meta.is_contiguous()):
        raise ValueError(f"extend: facts {tuple(meta.shape)} {meta.dtype} for tokens {tuple(tokens.shape)} "
                         f"{tokens.dtype}: want contiguous int64 (S,) and (S, {abi.META_COLUMNS})")
    if len(index_len) != held.count:
        raise ValueError(f"extend: {len(index_len)} main-order lengths for {held.count} layers")
    x1 = torch.empty(rows, hidden, dtype=torch.float32)  # scratch the C side fills
    x2 = torch.empty_like(x1)
    logits = torch.empty((rows, held.vocab) if all_rows else (held.vocab,), dtype=torch.float32)
    lengths = (ctypes.c_int64 * len(index_len))(*index_len)
    table = cache.block_table
    status = kernel.extend_raw(rows, hidden, held.count, held.layers, held.floats, held.hashes, held.embedding,
                               tokens.data_ptr(), x1.data_ptr(), x2.data_ptr(), meta.data_ptr(), lengths,
                               table.data_ptr(), table.shape[1], table.shape[0], cache.block_size, cache.scratch_slot,
                               *held.final, held.final_eps, *held.head, held.vocab, logits.data_ptr(),
                               torch.get_num_threads(), fused.linears.weights_code, int(all_rows))
    index_len[:] = list(lengths)  # the merges it made, also when it failed after them
    check_status(status, "extend kernel")
    return logits


__all__ = ["extend_rows"]
