"""Incremental decoding state. This first version recomputes the full forward per step (exact, slow);
the LSH window cache replaces it (issue 6) behind the same two calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .reformer import ReformerLM


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        return 8 * len(self.ids)


@torch.no_grad()
def prefill(lm: ReformerLM, input_ids: Tensor) -> tuple[Tensor, DecodeState]:
    ids = input_ids.reshape(-1)
    logits = lm(ids.unsqueeze(0)).logits[0, -1]
    return logits, DecodeState(ids=[int(i) for i in ids.tolist()])


@torch.no_grad()
def decode_step(lm: ReformerLM, token_ids: Tensor, states: list[DecodeState]) -> Tensor:
    out = []
    device = next(lm.parameters()).device
    for tok, st in zip(token_ids.tolist(), states):
        st.ids.append(int(tok))
        out.append(lm(torch.tensor([st.ids], device=device)).logits[0, -1])
    return torch.stack(out)
