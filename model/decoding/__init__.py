"""Cached decoding: a paged key/value cache with each LSH layer's bucket-sorted index (cache.py, lsh_index.py),
batched prefill in slices a scheduler can interleave with decode steps (prefill/), and a decoder that runs one
batched decode step for every running request (step.py) on backends it chooses once (steps/: the fused C step,
the PyTorch step with C pieces, CUDA graphs), and an extend: one request's new tokens in one call, leaving what
one step per token leaves (extend.py). `generate` strings them together for tools and tests."""

from .cache import DecodeCache
from .cache_state import CacheFull, DecodeState
from .prefill import prefill, prefill_steps
from .step import INVARIANT_ROWS, Decoder, batch_bucket
from .threads import (
    SINGLE_THREAD_PREFILL_TOKENS,
    SINGLE_THREAD_ROWS,
    prefill_threads,
    sampling_threads,
    step_threads,
)

__all__ = ["INVARIANT_ROWS", "SINGLE_THREAD_PREFILL_TOKENS", "SINGLE_THREAD_ROWS", "CacheFull", "DecodeCache",
           "DecodeState", "Decoder", "batch_bucket", "prefill", "prefill_steps", "prefill_threads",
           "sampling_threads", "step_threads"]
