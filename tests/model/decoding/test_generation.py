from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding.generate import generate
from model.sampling import Sampler, SamplingParams, filter_top_k_top_p, greedy_choices

from ..helpers import tiny_config


@pytest.fixture(scope="module")
def lm() -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3)).eval()


def test_greedy_equals_argmax_of_full_forward(lm: ReformerLM) -> None:
    prompt = list(range(10, 40))
    new = generate(lm, prompt, 12, use_cache=False)
    ids = list(prompt)
    for _ in range(12):
        with torch.no_grad():
            ids.append(int(lm(torch.tensor([ids])).logits[0, -1].argmax()))
    assert new == ids[len(prompt):]


def test_cached_and_uncached_generation_agree() -> None:
    # exact for a model whose LSH layer sits on top of local layers (see tests/model/test_decode.py)
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, attn_layers=["local", "lsh"])).eval()
    prompt = list(range(20, 45))
    assert generate(lm, prompt, 20, use_cache=True) == generate(lm, prompt, 20, use_cache=False)


def test_sampling_is_reproducible_from_the_seed(lm: ReformerLM) -> None:
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    a = generate(lm, [5, 6, 7], 15, params)
    b = generate(lm, [5, 6, 7], 15, params)
    c = generate(lm, [5, 6, 7], 15, SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=8))
    assert a == b and a != c


def test_stop_ids_end_generation(lm: ReformerLM) -> None:
    first = generate(lm, [9, 9, 9], 5)
    out = generate(lm, [9, 9, 9], 5, stop_ids=[first[1]])
    assert out == first[: first.index(first[1]) + 1]


def test_top_k_top_p_filters() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)[2:]).all()
    kept = ~torch.isinf(filter_top_k_top_p(logits, 0, 0.5))
    assert kept.tolist() == [True, False, False, False, False]
    assert not torch.isinf(filter_top_k_top_p(logits, 0, 1.0)).any()


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.tensor([2.0, 1.9, -1.0])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    assert sampler.next_token(logits, previous=[0])[0] == 1


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(repetition_penalty=float("nan"))])
def test_invalid_sampling_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_extreme_but_valid_sampling_values_stay_finite() -> None:
    logits = torch.tensor([3.0, 1.0, -2.0])
    for params in (SamplingParams(do_sample=True, temperature=1e-300, seed=1),
                   SamplingParams(do_sample=True, top_p=5e-324, seed=1),
                   SamplingParams(repetition_penalty=1e-300)):
        token, logprob = Sampler(params).next_token(logits, previous=[0])
        assert token in (0, 1, 2) and logprob == logprob  # not NaN
    assert Sampler(SamplingParams(do_sample=True, top_p=5e-324, seed=3)).next_token(logits)[0] == 0


def test_batched_greedy_choices_equal_each_row_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(33, 258) * 5
    logits[3, [7, 9]] = 50.0  # a tie: the first maximum wins, as argmax of the row alone
    sampler = Sampler(SamplingParams())
    assert sampler.plain_greedy
    for b in (1, 3, 16, 33):
        assert greedy_choices(logits[:b]) == [sampler.next_token(row) for row in logits[:b]]  # bit for bit
    assert greedy_choices(logits)[3][0] == 7
    assert not Sampler(SamplingParams(repetition_penalty=1.2)).plain_greedy
    assert not Sampler(SamplingParams(do_sample=True, temperature=0.7)).plain_greedy
    assert Sampler(SamplingParams(do_sample=True, temperature=1e-6)).plain_greedy
