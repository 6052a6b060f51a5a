"""Invariant 6: the reversible backward gives the gradients of plain autograd, dropout included."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM

from .helpers import random_ids, tiny_config


def _grads(lm: ReformerLM, ids: torch.Tensor, reversible: bool, seed: int) -> dict[str, torch.Tensor]:
    lm.zero_grad()
    lm.reversible = reversible
    torch.manual_seed(seed)
    logits = lm(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_reversible_gradients_equal_plain_autograd(dropout: float) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(initializer_range=0.1, hidden_dropout_prob=dropout, lsh_attention_probs_dropout_prob=dropout,
                      local_attention_probs_dropout_prob=dropout)
    lm = ReformerLM(cfg).train()
    ids = random_ids(2, 64)
    rev = _grads(lm, ids, reversible=True, seed=5)
    plain = _grads(lm, ids, reversible=False, seed=5)
    assert rev.keys() == plain.keys() and len(rev) == len(list(lm.parameters()))
    for name in rev:
        assert torch.allclose(rev[name], plain[name], atol=1e-5, rtol=1e-4), name


def test_dropout_changes_with_the_seed() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(hidden_dropout_prob=0.3)).train()
    ids = random_ids(1, 32)
    torch.manual_seed(1)
    a = lm(ids).logits
    torch.manual_seed(2)
    b = lm(ids).logits
    assert not torch.equal(a, b)


def _train_two_steps() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1)).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    for step in range(2):
        ids = random_ids(2, 64, seed=step)
        logits = lm(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in lm.state_dict().items()}


def test_two_training_steps_are_bit_identical() -> None:
    first, second = _train_two_steps(), _train_two_steps()
    assert all(torch.equal(first[k], second[k]) for k in first)
