"""Next-token selection: greedy or sampled with temperature, top-k, top-p and a repetition penalty.
Each request owns its generator, so its tokens depend only on its seed, never on its batch-mates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    repetition_penalty: float = 1.0  # 1.0: none; >1 discourages tokens already in the sequence
    do_sample: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a positive finite number, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: Tensor, previous: Sequence[int], penalty: float) -> Tensor:
    """CTRL-style penalty as in transformers: positive logits divided, negative multiplied."""
    if penalty == 1.0 or not previous:
        return logits
    idx = torch.tensor(sorted(set(previous)), dtype=torch.long, device=logits.device)
    idx = idx[idx < logits.shape[-1]]
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[0] = False  # even a top_p that rounds to 0 keeps the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's convention)
MIN_FACTOR = 1e-6


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        """Sampling is off, or its temperature is below MIN_TEMPERATURE: the argmax is taken."""
        return not self.params.do_sample or self.params.temperature < MIN_TEMPERATURE

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no repetition penalty: the choice `greedy_choices` makes for a whole batch at once."""
        return self.greedy and self.params.repetition_penalty == 1.0

    def next_token(self, logits: Tensor, previous: Sequence[int] = ()) -> tuple[int, float]:
        """logits (vocab,) -> (token id, its log-probability under the distribution it was drawn from)."""
        p = self.params
        logits = logits.detach().float().cpu()
        # a penalty or temperature that underflows float32 would turn logits into inf/NaN
        logits = apply_repetition_penalty(logits, previous, max(p.repetition_penalty, MIN_FACTOR))
        if self.greedy:
            token = int(torch.argmax(logits).item())
            return token, float(torch.log_softmax(logits, -1)[token].item())
        logits = filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator).item())
        return token, float(logprobs[token].item())


def greedy_choices(logits: Tensor) -> list[tuple[int, float]]:
    """logits (B, vocab) -> each row's greedy (token, log-probability) in two batched ops and one host copy:
    the same values `Sampler.next_token` gives a plain-greedy row alone (argmax keeps the first maximum and
    a row's log_softmax does not depend on the other rows; tests/model/test_generation.py checks both)."""
    logits = logits.detach().float().cpu()
    tokens = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return list(zip(tokens.tolist(), logprobs.tolist(), strict=True))
