"""Intra-op thread policy of the model's calls on the CPU: one thread for small steps, prefills and the
sampling between calls, the rest for large ones. torch.set_num_threads is process-wide, so only the one thread
that runs model calls (the service's model runner, bench/decode/generate.py) uses these."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A step over at most this many rows is hundreds of tiny ops: a second intra-op thread only adds a hand-off
# per op (CPU time twice the wall time), so it runs on one thread. A larger step leaves one core to the rest
# of the process: in the service the event loop that delivers the step's tokens runs beside it, and intra-op
# threads that must wait for a busy core at every op barrier lose more than they gain. Measured with the
# engine and the shipped model, 2 cores, 128-token generations of 256-token prompts (a hand measurement):
# 8 streams, model step 7.5 ms on 2 threads against 3.6 ms on 1; 32 streams, 12.1 against 9.5 ms.
SINGLE_THREAD_ROWS = 4


@contextmanager
def _intra_op_threads(want: int, device: torch.device | None) -> Iterator[None]:
    """Run the block on `want` intra-op threads and restore the count after; a non-CPU device is left alone
    (intra-op threads are a CPU matter). torch.set_num_threads is process-wide: only the model's callers (the
    service's model runner, bench/decode/generate.py) use this, from the one thread that runs model calls."""
    before = torch.get_num_threads()
    if want == before or (device is not None and device.type != "cpu"):
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_threads(rows: int, device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for a CPU step of at most SINGLE_THREAD_ROWS rows, all but one of the threads for
    a larger one, restored after (`_intra_op_threads`)."""
    before = torch.get_num_threads()
    return _intra_op_threads(1 if rows <= SINGLE_THREAD_ROWS else max(before - 1, 1), device)


# A prefill of at most this many padded tokens (prompts times the longest) runs on one intra-op thread: its ops
# are small enough that a second thread, whose core the service's event loop and clients also use, costs more
# than it gives. Measured with `reformer serve` and the shipped model on 2 cores (`reformer loadtest`,
# 256-byte prompts, 128 new tokens): /generate_stream TTFT p50 at concurrency 1 35-39 ms without the rule,
# 26-31 ms with it (three runs each, bench/results/loadtest_prefill_threads/ and bench/README.md); tokens/s
# at concurrency 1 and 8 within the spread between runs of either code.
SINGLE_THREAD_PREFILL_TOKENS = 2048


def prefill_threads(tokens: int, device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for a CPU prefill of at most SINGLE_THREAD_PREFILL_TOKENS padded tokens, the
    threads as they are for a larger one, restored after (`_intra_op_threads`)."""
    before = torch.get_num_threads()
    return _intra_op_threads(1 if tokens <= SINGLE_THREAD_PREFILL_TOKENS else before, device)


def sampling_threads(device: torch.device | None = None) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for the small tensor ops between model calls (a step's greedy choices, a row's
    sampling), restored after (`_intra_op_threads`). On more threads each op of a few microseconds is an
    OpenMP region whose hand-off to a thread parked during the step, on a core the service's event loop and
    clients keep busy, costs far more than the op. Measured in-process on 2 cores with the other core kept busy
    by a spinning process, shipped model, 8 rows: a step plus its greedy choice 2.9-6.2 ms with the choice on
    two threads, 1.7-2.8 ms on one (no difference with the other core idle)."""
    return _intra_op_threads(1, device)
