"""CUDA graphs of the batched decode step: a step is hundreds of small kernels whose launches, not their
arithmetic, set its time on a GPU; a captured graph replays them all with one launch.

A step's device work (model/decoding/steps/torch_step.py `step_compute`) reads two inputs, the tokens (B,) and the rows'
facts (B, 7), and otherwise only the cache's tensors, which stay where they are (preallocated pools, local
layers' rings addressed by slot and position alone, block table, LSH indexes). Its shapes depend only on
the padded row count B and on a few host-known facts (whether every row already hashes, the bucket count the
rows hash with), so one graph per such key serves every step with that key: each replay first copies the
step's inputs into the graph's own input buffers.

- A key is run eagerly the first time it is seen (warm-up: lazy initialisation of kernels and handles must
  not happen inside a capture), captured the second time, and replayed from then on; the capture does not
  execute the step, so that step then replays it once.
- Steps whose rows hash with different bucket counts (rows grouped by boolean index, host-built index
  tensors) are not captured: they run eagerly.
- The key holds the addresses of the LSH indexes' tensors: an automatic bucket count that grows an index
  reallocates it, and the graphs recorded against the old tensors are dropped.
- A capture that fails is logged once and its key runs eagerly from then on.

`capture` is how a graph is recorded: `cuda_capture` (torch.cuda.CUDAGraph) on a GPU; tests pass a
function that replays by calling the step again, which checks the buffers and keys on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..cache import DecodeCache

log = logging.getLogger("model.step_graphs")

StepFn = Callable[[Tensor, Tensor], Tensor]  # (tokens (B,), meta (B, 7)) -> logits (B, vocab)
Replay = Callable[[], Tensor]
Capture = Callable[[Callable[[], Tensor]], Replay]


def cuda_capture(fn: Callable[[], Tensor]) -> Replay:
    """Record fn's kernels in a CUDA graph (its outputs live in the graph's memory pool); the replay runs them
    again on whatever the input buffers hold and returns the same output tensor."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


@dataclass
class _Entry:
    tokens: Tensor
    meta: Tensor
    replay: Replay | None = None
    seen: int = 0
    failed: bool = False


@dataclass
class StepGraphs:
    capture: Capture = cuda_capture
    entries: dict[Hashable, _Entry] = field(default_factory=dict)
    replays: int = 0  # steps served by a graph (tests and the GPU check read it)
    captures: int = 0

    def run(self, step: StepFn, tokens: Tensor, meta: Tensor, key: Hashable, cache: DecodeCache,
            single_group: bool = True) -> Tensor | None:
        """The step's logits (B, vocab) from a graph, or None when the caller must run it eagerly (first sight
        of the key, an uncapturable structure, a failed capture)."""
        if not single_group:
            return None
        pointers = tuple(tuple(t.data_ptr() for t in ix.tensors()) for ix in cache.indexes if ix is not None)
        full_key = (key, pointers)
        entry = self.entries.get(full_key)
        if entry is None:
            self._drop_stale(pointers)
            entry = self.entries[full_key] = _Entry(torch.empty_like(tokens, device=cache.device),
                                                    torch.empty_like(meta, device=cache.device))
        if entry.failed:
            return None
        entry.seen += 1
        if entry.seen == 1:
            return None  # warm-up: eagerly, outside any capture
        entry.tokens.copy_(tokens, non_blocking=True)
        entry.meta.copy_(meta, non_blocking=True)
        if entry.replay is None:
            try:
                entry.replay = self.capture(lambda: step(entry.tokens, entry.meta))
            except Exception:
                log.warning("capturing the decode step for %r failed; it runs eagerly", key, exc_info=True)
                entry.failed = True
                return None
            self.captures += 1
        self.replays += 1
        # a copy: the graph's output buffer is overwritten by the next replay (invariant mode replays one key
        # for several row blocks of the same step)
        return entry.replay().clone()

    def _drop_stale(self, pointers: tuple[tuple[int, ...], ...]) -> None:
        stale = [k for k in self.entries if k[1] != pointers]  # type: ignore[index]
        for k in stale:
            del self.entries[k]
