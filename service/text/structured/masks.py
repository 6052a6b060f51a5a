"""Each constrained sequence's matcher, and the allowed tokens of a whole decode batch computed at once.

The engine asks for a batch's masks before the model's decode step and collects them after it
(`MaskBatch.submit` then `.result`): a matcher's state depends only on the tokens its sequence has taken,
all known before the step, so the masks are computed on a helper thread (llguidance releases the GIL while
it computes) while the model runs. A row's mask depends on its own matcher alone, so a constrained
sequence takes the same tokens batched or alone."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from service.jobs import OutputConstraint
from service.text.structured.grammars import CompiledGrammar


class ConstraintFailed(Exception):
    """A sequence's matcher refused a token or ran out of its per-step limits (llguidance's lexer fuel)."""


class SequenceConstraint:
    """One sequence's place in its grammar: a deep copy of the compiled grammar's pristine matcher, advanced by
    each token the sequence takes."""

    def __init__(self, grammar: OutputConstraint) -> None:
        if not isinstance(grammar, CompiledGrammar):
            raise TypeError(f"not a compiled grammar: {type(grammar).__name__}")
        self.matcher = grammar.matcher.deep_copy()

    def consume(self, token: int) -> None:
        """The sequence took `token` (one its mask allowed)."""
        if not self.matcher.consume_token(token):
            raise ConstraintFailed(self.matcher.get_error() or f"token {token} does not fit the grammar")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows no further token: the sequence ends here (as at end of text)."""
        return bool(self.matcher.is_stopped())


@dataclass(frozen=True)
class Masks:
    """A batch's allowed tokens: (rows, vocab) booleans, every token allowed in an unconstrained row, and the
    seconds computing them took (on the helper thread)."""

    allowed: torch.Tensor
    seconds: float


class MaskBatch:
    """Computes the allowed tokens of a batch's constrained rows, row after row on one helper thread. Not with
    llguidance's batch executor: its hand-off to its own threads cost more than the masks themselves in the
    service (8 rows of the shipped byte vocabulary: 1.0-1.7 ms a batch through the executor, 66-84 µs row by
    row, bench/serving/structured_output.py on the shared 2-core machine at load 7)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._bits = torch.arange(32, dtype=torch.int32)

    def submit(self, rows: list[SequenceConstraint | None]) -> Future[Masks] | None:
        """Start computing the masks of `rows` (None: an unconstrained row); None when no row is constrained."""
        if not any(row is not None for row in rows):
            return None
        return self._helper.submit(self.compute, rows)

    def compute(self, rows: list[SequenceConstraint | None]) -> Masks:
        began = time.perf_counter()
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)  # unconstrained rows: all allowed
        for i, row in enumerate(rows):
            if row is not None:  # llguidance releases the GIL while it computes
                row.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), self.words * 4)
        allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).bool().reshape(len(rows), -1)[:, :self.vocab_size]
        return Masks(allowed, time.perf_counter() - began)

    def close(self) -> None:
        self._helper.shutdown(wait=False, cancel_futures=True)


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A new (rows, vocab) tensor with every token not allowed at -inf (the input is left as it is: a
    prefill's logits may be shared with forks and the prefix cache). Ids past the mask's vocabulary (a model
    head wider than its tokenizer) are not allowed either."""
    width = allowed.shape[-1]
    out = logits.clone()
    out[:, :width] = logits[:, :width].masked_fill(~allowed.to(logits.device), float("-inf"))
    if logits.shape[-1] > width:
        out[:, width:] = float("-inf")
    return out
