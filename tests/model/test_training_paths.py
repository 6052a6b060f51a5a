"""Training's fast attention paths compute the old paths' function and gradients: the one-pass softmax
(`chunking.OnePassAttend`, used by LSH and dense attention under autograd) and the fused local-attention
kernel (`LocalSelfAttention._chunked_sdpa`). Each is checked against the plain autograd formulation it
replaces, and the training forward against the transformers reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from model import ReformerLM, attention, chunking
from model.attention import LocalSelfAttention
from model.chunking import OnePassAttend
from model.lsh.masks import attention_bias

from .helpers import random_ids, reference_pair, tiny_config


def _bias(causal: bool, dtype: torch.dtype, masked_rows: bool) -> torch.Tensor:
    # window positions drawn with repeats, so some rows see themselves twice and some only themselves
    q_pos = torch.arange(12).view(1, 1, 3, 4)
    k_pos = torch.randint(0, 12, (1, 1, 3, 8), generator=torch.Generator().manual_seed(3))
    if masked_rows:  # chunk 0 sees only future keys (or itself, twice): rows with nothing allowed
        k_pos[..., 0, :] = 11
    return attention_bias(q_pos, k_pos, None, causal, True, dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_one_pass_attend_gradcheck(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, n, 5, dtype=torch.double, generator=g).requires_grad_() for n in (4, 8, 8))
    bias = _bias(causal, torch.double, False)  # (finite differences of -1e9 + x are noise)
    assert torch.autograd.gradcheck(lambda a, b, c: OnePassAttend.apply(a, b, c, bias), (q, k, v))
    for i in (0, 1):  # each output alone: the backward gets None for the other
        assert torch.autograd.gradcheck(lambda a, b, c, i=i: OnePassAttend.apply(a, b, c, bias)[i], (q, k, v))


def test_one_pass_attend_equals_autograd_formulation() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 3, n, 5, generator=g) for n in (4, 8, 8))
    bias = _bias(True, torch.float32, True)
    w_out, w_lse = torch.randn(2, 2, 3, 4, 5, generator=g), torch.randn(2, 2, 3, 4, generator=g)

    def run(fast: bool) -> list[torch.Tensor]:
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        if fast:
            out, lse = OnePassAttend.apply(*xs, bias)
        else:
            dots = torch.matmul(xs[0], xs[1].transpose(-1, -2)) + bias
            lse = torch.logsumexp(dots, dim=-1)
            out = torch.matmul(torch.exp(dots - lse.unsqueeze(-1)), xs[2])
        ((out * w_out).sum() + (lse * w_lse).sum()).backward()
        return [out.detach(), lse.detach(), *(x.grad for x in xs)]  # type: ignore[misc]

    for got, want in zip(run(True), run(False)):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def _old_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunking, "one_pass_ok", lambda *a: False)
    monkeypatch.setattr(LocalSelfAttention, "_sdpa_applies", staticmethod(lambda *a: False))


def _grads(lm: ReformerLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    lm.zero_grad()
    logits = lm(ids[:, :-1]).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"one_pass": 0, "sdpa": 0}
    apply, sdpa = OnePassAttend.apply, F.scaled_dot_product_attention

    def counted_apply(*a: Any) -> Any:
        calls["one_pass"] += 1
        return apply(*a)

    def counted_sdpa(*a: Any, **kw: Any) -> Any:
        calls["sdpa"] += 1
        return sdpa(*a, **kw)

    monkeypatch.setattr(OnePassAttend, "apply", counted_apply)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted_sdpa)
    return calls


@pytest.mark.parametrize("reversible", [False, True])
@pytest.mark.parametrize("layers,before,length", [
    (["local", "lsh", "local", "lsh"], 1, 64),
    (["local", "lsh", "local", "lsh"], 2, 48),
    (["lsh", "local"], 1, 8),  # one chunk: dense attention in both kinds of layer
])
def test_training_gradients_equal_old_paths(monkeypatch: pytest.MonkeyPatch, reversible: bool,
                                            layers: list[str], before: int, length: int) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(initializer_range=0.1, attn_layers=layers, lsh_num_chunks_before=before,
                                local_num_chunks_before=before)).train()
    lm.reversible = reversible
    ids = random_ids(2, length + 1)
    with monkeypatch.context() as m:
        calls = _count_calls(m)
        fast = _grads(lm, ids)
    # the fast paths ran: one-pass softmax in every LSH layer (and dense layer), fused kernel in local layers
    assert calls["one_pass"] > 0
    assert calls["sdpa"] > 0 or length <= 8
    with monkeypatch.context() as m:
        _old_paths(m)
        old = _grads(lm, ids)
    assert fast.keys() == old.keys() and len(fast) == len(list(lm.parameters()))
    for name in fast:
        assert torch.allclose(fast[name], old[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("overrides,length", [({}, 64), ({"is_decoder": False, "lsh_num_chunks_after": 1,
                                                           "local_num_chunks_after": 1}, 64), ({}, 40)])
def test_training_forward_matches_reference(overrides: dict[str, Any], length: int) -> None:
    hf, lm = reference_pair(**overrides)
    lm.train()  # dropout is 0: the training forward computes the eval function
    ids = random_ids(2, length)
    with torch.no_grad():
        expected = hf(ids, use_cache=False).logits
    with torch.enable_grad():
        got = lm(ids).logits
    assert got.requires_grad
    assert (got.detach() - expected).abs().max().item() <= 1e-4
