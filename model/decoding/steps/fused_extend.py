"""One request's new tokens through every layer in one C call (model/kernels/csrc/extend_layers.c), on the layer
descriptions the one-call step builds (fused.py `FusedStep.described`). The call leaves the logits of its last
row and the cache as the same tokens fed one decode step each leave them, bit for bit
(tests/model/decoding/test_extend.py); model/decoding/extend.py chooses it and splits long extends."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...kernels import CpuKernels, abi
from ...kernels.bindings import check_status
from .fused import FusedStep

if TYPE_CHECKING:
    from ...reformer import ReformerLM
    from ..cache import DecodeCache


def extend_rows(fused: FusedStep, lm: ReformerLM, cache: DecodeCache, window: CpuKernels | None,
                tokens: Sequence[int], meta: Sequence[Sequence[int]], bucket_count: int | list[int],
                index_len: list[int]
                ) -> Tensor | None:
    """tokens (S ints) of one request at consecutive positions, meta (S rows of abi.META_COLUMNS ints) their
    facts (model/decoding/step.py `row_facts`), every row hashing with the fixed `bucket_count`; index_len the
    request's main-order length per layer, updated in place by the merges the call makes. Returns the last
    row's logits (vocab,) float32, or None where the one-call path does not apply (nothing done)."""
    kernel = fused.linears.kernel
    held = fused.described(lm, cache, window, [(bucket_count, None)])
    if held is None or kernel is None or held.hashes is None:
        return None
    rows, hidden = len(tokens), held.hidden
    if rows < 1 or len(meta) != rows or any(len(m) != abi.META_COLUMNS for m in meta):
        raise ValueError(f"extend: {len(meta)} rows of facts for {rows} tokens (each {abi.META_COLUMNS} words)")
    if len(index_len) != held.count:
        raise ValueError(f"extend: {len(index_len)} main-order lengths for {held.count} layers")
    x1 = torch.empty(rows, hidden, dtype=torch.float32)  # scratch the C side fills
    x2 = torch.empty_like(x1)
    logits = torch.empty(held.vocab, dtype=torch.float32)
    lengths = (ctypes.c_int64 * len(index_len))(*index_len)
    table = cache.block_table
    status = kernel.extend_raw(rows, hidden, held.count, held.layers, held.floats, held.hashes, held.embedding,
                               (ctypes.c_int64 * rows)(*tokens), x1.data_ptr(), x2.data_ptr(),
                               (ctypes.c_int64 * (rows * abi.META_COLUMNS))(*itertools.chain.from_iterable(meta)),
                               lengths, table.data_ptr(), table.shape[1], table.shape[0], cache.block_size,
                               cache.scratch_slot, *held.final, held.final_eps, *held.head, held.vocab,
                               logits.data_ptr(), torch.get_num_threads(), fused.linears.weights_code)
    index_len[:] = list(lengths)  # the merges it made, also when it failed after them
    check_status(status, "extend kernel")
    return logits


__all__ = ["extend_rows"]
