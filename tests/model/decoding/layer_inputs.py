"""The input a forward's first layer sees, for tests that run one layer whole and in prefill slices."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model import ReformerLM
from model.batch import PreparedBatch, prepare_batch


def random_batch(lm: ReformerLM, lengths: list[int], g: torch.Generator) -> PreparedBatch:
    """A padded batch of random ids of these lengths (drawn from `g`), masked where it is padding."""
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 258, (n,), generator=g)
        mask[i, :n] = 1
    return prepare_batch(ids, None if min(lengths) == longest else mask, lm.config)


def layer_inputs(lm: ReformerLM, lengths: list[int], seed: int = 5) -> tuple[Tensor, Any]:
    """The embedded, padded batch of random ids of these lengths, with noise added so every layer sees varied
    inputs, and its attention context."""
    g = torch.Generator().manual_seed(seed)
    batch = random_batch(lm, lengths, g)
    with torch.no_grad():
        x = lm.embeddings(batch.input_ids)
    return x + 0.5 * torch.randn(x.shape, generator=g), batch.context
