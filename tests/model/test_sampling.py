"""The sampler's bias, penalties, typical-p filter, alternatives and per-choice seeds."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampling import Sampler, SamplingParams, choice_seed, top_alternatives
from model.warpers import apply_frequency_presence, apply_logit_bias, filter_typical_p


def test_logit_bias_moves_the_greedy_choice_and_its_logprob() -> None:
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])
    assert Sampler(SamplingParams()).next_token(logits)[0] == 0
    token, logprob = Sampler(SamplingParams(logit_bias=((2, 10.0),))).next_token(logits)
    biased = torch.tensor([3.0, 1.0, 10.0, -1.0])
    assert token == 2 and logprob == pytest.approx(float(torch.log_softmax(biased, -1)[2]))
    assert torch.equal(apply_logit_bias(logits, [(1, -100.0)]), torch.tensor([3.0, -99.0, 0.0, -1.0]))


def test_frequency_and_presence_penalties_count_only_generated_tokens() -> None:
    logits = torch.zeros(4)
    out = apply_frequency_presence(logits, [1, 1, 2], frequency=0.5, presence=2.0)
    assert torch.equal(out, torch.tensor([0.0, -3.0, -2.5, 0.0]))
    near_tie = torch.tensor([1.0, 0.9, 0.0, 0.0])
    sampler = Sampler(SamplingParams(frequency_penalty=1.0))
    assert sampler.next_token(near_tie, previous=[0, 0], generated=[]) == Sampler(SamplingParams()).next_token(near_tie)
    assert sampler.next_token(near_tie, previous=[0], generated=[0])[0] == 1
    assert Sampler(SamplingParams(presence_penalty=0.5)).next_token(near_tie, generated=[0])[0] == 1


def test_typical_p_matches_transformers_typical_warper() -> None:
    from transformers.generation.logits_process import TypicalLogitsWarper

    gen = torch.Generator().manual_seed(0)
    for mass in (0.2, 0.5, 0.9, 0.99):
        logits = torch.randn(50, generator=gen) * 3
        ours = filter_typical_p(logits, mass)
        theirs = TypicalLogitsWarper(mass)(torch.zeros(1, 1, dtype=torch.long), logits.unsqueeze(0))[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), mass
        assert torch.isinf(ours).any()  # each mass here drops something
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert not torch.isinf(filter_typical_p(logits, 1.0)).any()
    assert int((~torch.isinf(filter_typical_p(logits, 1e-9))).sum()) == 1  # at least one stays
    # the head (surprisal nearest the entropy) is the one kept at a small mass: sampling always draws it
    draws = {Sampler(SamplingParams(do_sample=True, typical_p=0.5, seed=s)).next_token(logits)[0] for s in range(20)}
    assert draws == {0}


def test_alternatives_are_the_most_likely_of_the_drawn_distribution() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 3.0])
    choice = Sampler(SamplingParams(top_logprobs=3)).choose(logits)
    logprobs = torch.log_softmax(logits, -1)
    assert [i for i, _ in choice.top] == [4, 1, 2] and choice.token == 4
    assert choice.top[0][1] == pytest.approx(choice.logprob)
    assert all(v == pytest.approx(float(logprobs[i])) for i, v in choice.top)
    # tokens top-k removed have no probability: they are left out, never reported as -inf
    sampled = Sampler(SamplingParams(do_sample=True, top_k=2, top_logprobs=4, seed=1)).choose(logits)
    assert {i for i, _ in sampled.top} == {4, 1} and all(math.isfinite(v) for _, v in sampled.top)
    assert top_alternatives(logprobs, 0) == ()


def test_choice_seeds_are_fixed_distinct_and_keep_choice_zero() -> None:
    assert choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(8)]
    assert len(set(seeds)) == 8 and seeds == [choice_seed(7, i) for i in range(8)]
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("bad", [dict(typical_p=0.0), dict(typical_p=1.5), dict(frequency_penalty=math.inf),
                                 dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, math.nan),)),
                                 dict(top_logprobs=-1)])
def test_bad_params_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_plain_greedy_only_without_bias_penalties_or_alternatives() -> None:
    assert Sampler(SamplingParams()).plain_greedy
    for params in (SamplingParams(logit_bias=((1, 1.0),)), SamplingParams(presence_penalty=0.1),
                   SamplingParams(frequency_penalty=0.1), SamplingParams(top_logprobs=1)):
        assert not Sampler(params).plain_greedy
