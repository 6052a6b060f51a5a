"""Next-token selection: greedy or sampled, after a logit bias, penalties and the sampling filters
(model/warpers.py), with the chosen token's log-probability and, when asked, the most likely alternatives.
Each request owns its generator, so its tokens depend only on its seed, never on its batch-mates: a row is
chosen from its own logits alone, batched or not."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.warpers import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    filter_top_k_top_p,
    filter_typical_p,
)

__all__ = ["Choice", "Sampler", "SamplingParams", "choice_seed", "filter_top_k_top_p", "greedy_choices",
           "top_alternatives"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    repetition_penalty: float = 1.0  # 1.0: none; >1 discourages tokens already in the sequence
    do_sample: bool = False
    seed: int | None = None
    typical_p: float = 1.0  # 1.0: no typical filter
    frequency_penalty: float = 0.0  # subtracted per earlier occurrence in the generated tokens
    presence_penalty: float = 0.0  # subtracted once a token has been generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    top_logprobs: int = 0  # the most likely alternatives reported with each token (0: none)

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 < self.typical_p <= 1.0):
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a positive finite number, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if any(i < 0 or not math.isfinite(v) for i, v in self.logit_bias):
            raise ValueError("logit_bias needs token ids >= 0 and finite values")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")

    @property
    def penalized(self) -> bool:
        """Whether anything changes the logits before the choice (a bias or a penalty)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))


@dataclass(frozen=True)
class Choice:
    """A chosen token, its log-probability under the distribution it was drawn from, and the `top_logprobs`
    most likely tokens of that distribution (id, log-probability), most likely first, tokens it excludes left
    out."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's convention)
MIN_FACTOR = 1e-6

_MASK63 = 2**63 - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (n or best_of choices): choice 0 keeps the seed,
    the others get a splitmix64 mix of (seed, index), so each choice is reproduced alone by a request with its
    own seed and n=1."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


def top_alternatives(logprobs: Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely (id, log-probability) of a (vocab,) row, most likely first, -inf ones left out."""
    if k <= 0:
        return ()
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if math.isfinite(v))


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
        """Greedy with nothing changing the logits and no alternatives asked: the choice `greedy_choices` makes
        for a whole batch at once."""
        return self.greedy and not self.params.penalized and self.params.top_logprobs == 0

    def next_token(self, logits: Tensor, previous: Sequence[int] = (), generated: Sequence[int] = ()
                   ) -> tuple[int, float]:
        """logits (vocab,) -> (token id, its log-probability under the distribution it was drawn from)."""
        choice = self.choose(logits, previous, generated)
        return choice.token, choice.logprob

    def choose(self, logits: Tensor, previous: Sequence[int] = (), generated: Sequence[int] = ()) -> Choice:
        """logits (vocab,) -> the Choice; `previous` is the whole sequence so far (the repetition penalty's),
        `generated` its generated part (the frequency and presence penalties')."""
        p = self.params
        logits = logits.detach().float().cpu()
        logits = apply_logit_bias(logits, p.logit_bias)
        # a penalty or temperature that underflows float32 would turn logits into inf/NaN
        logits = apply_repetition_penalty(logits, previous, max(p.repetition_penalty, MIN_FACTOR))
        logits = apply_frequency_presence(logits, generated, p.frequency_penalty, p.presence_penalty)
        if self.greedy:
            token = int(torch.argmax(logits).item())
            logprobs = torch.log_softmax(logits, -1)
        else:
            logits = filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
            logits = filter_typical_p(logits, p.typical_p)
            logprobs = torch.log_softmax(logits, dim=-1)
            token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator).item())
        return Choice(token, float(logprobs[token].item()), top_alternatives(logprobs, p.top_logprobs))


def greedy_choices(logits: Tensor) -> list[tuple[int, float]]:
    """logits (B, vocab) -> each row's greedy (token, log-probability) in two batched ops and one host copy:
    the same values `Sampler.next_token` gives a plain-greedy row alone (argmax keeps the first maximum and
    a row's log_softmax does not depend on the other rows; tests/model/test_generation.py checks both)."""
    logits = logits.detach().float().cpu()
    tokens = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return list(zip(tokens.tolist(), logprobs.tolist(), strict=True))
