"""Structured output in the generation steps: the constrained rows' masks, started before a model call and
applied to its logits after it, as one mask over the batch before any row is sampled.

A decode step's masks are computed while the model's step runs (service/text/structured/masks.py MaskBatch,
on a helper thread): what the step waits for afterwards is only what the masks took beyond the model's time.
A prefill's first tokens have no model call left to hide behind; their masks are computed when the prefill
ends."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from service.engine.jobs_runtime import GenerationJob
from service.text.structured import MaskBatch, SequenceConstraint, apply_allowed
from service.text.structured.masks import Masks

Pending = Future[Masks] | None
log = logging.getLogger("service.engine")


class ConstrainedRows:
    """Masks for the rows of a batch that sample under a constraint. `observe` gets each batch's mask time in
    seconds (the metrics' histogram)."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self.observe = observe
        self._masks: MaskBatch | None = None

    def start(self, jobs: Sequence[GenerationJob]) -> Pending:
        """Begin the masks of the jobs that will sample from the coming logits (not those still reading their
        prompt); None when none of them is constrained."""
        rows: list[SequenceConstraint | None] = [None if j.feeding else j.constraint for j in jobs]
        if not any(row is not None for row in rows):
            return None
        if self._masks is None:
            self._masks = MaskBatch(jobs[0].tokenizer.vocab_size)
        return self._masks.submit(rows)

    def apply(self, pending: Pending, logits: torch.Tensor, jobs: Sequence[GenerationJob]) -> torch.Tensor:
        """The logits with the masks of `start` (over the same `jobs`) applied (a new tensor), or the logits
        themselves when no row is constrained. Waits for the masks if they are not done yet; each constrained
        job's trace counts the batch's mask time."""
        if pending is None:
            return logits
        masks = pending.result()
        self.observe(masks.seconds)
        for job in jobs:
            if job.constraint is not None and not job.feeding:
                job.timings.mask_s += masks.seconds
                job.timings.mask_steps += 1
        return apply_allowed(logits, masks.allowed)

    def first(self, jobs: Sequence[GenerationJob], states: Sequence[Any], logits: torch.Tensor,
              fail: Callable[[list[GenerationJob]], None]) -> torch.Tensor | None:
        """A prefill's logits masked for its jobs' first tokens (no model call left to overlap: computed now);
        None when the masks failed, the jobs then failed with their states (so that failing frees them)."""
        try:
            return self.apply(self.start(jobs), logits, jobs)
        except Exception:
            log.exception("structured-output masks over %d first tokens failed", len(jobs))
            for job, state in zip(jobs, states, strict=True):
                job.cache = state
            fail(list(jobs))
            return None

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()
