"""Successor-value heads through the sliced prefill (model/decoding/prefill/): the sliced attention equals the
forward's layer bit for bit, the cache's value slots of those heads hold the next position's value (0 at each
prompt's last position, which the first decode step writes), and a prefill's logits are the forward's."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import Tensor

from model import ReformerLM
from model.decoding import DecodeCache, prefill
from model.decoding.prefill.slices import attention_slices, layer_f_slices

from ..helpers import tiny_config
from .layer_inputs import layer_inputs


def _drain(gen: Generator[None, None, Any]) -> Any:
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def _model(successor: int | list[int], **overrides: Any) -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, lsh_successor_heads=successor,
                                  **overrides)).eval()



LENGTHS = [[200], [131, 200, 77], [5, 150], [3, 8]]


@pytest.mark.parametrize("successor", [1, 2])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["-".join(map(str, x)) for x in LENGTHS])
@pytest.mark.parametrize("fused,c_kernel", [(True, True), (True, False), (False, False)],
                         ids=["c-kernel", "flash", "plain"])
@pytest.mark.parametrize("slice_chunks", [1, 1000])
def test_sliced_successor_layer_equals_the_full_layer(successor: int, lengths: list[int], fused: bool,
                                                      c_kernel: bool, slice_chunks: int) -> None:
    lm = _model(successor, attn_layers=["lsh", "lsh"], num_hashes=3)
    layer: Any = lm.layers[1]
    att = layer.attention.self_attention
    att.fused, att.c_kernel = fused, c_kernel
    x, ctx = layer_inputs(lm, lengths)
    last = torch.tensor(lengths) - 1
    with torch.no_grad():
        whole, _ = layer.f(x, ctx, None)
        sliced = _drain(layer_f_slices(layer, x, ctx, slice_chunks))
        att_whole = _drain(attention_slices(att, layer.attention.layer_norm(x), ctx, slice_chunks))
        at_last = _drain(attention_slices(att, layer.attention.layer_norm(x), ctx, slice_chunks, only=last))
    assert torch.equal(sliced, whole)
    want = att_whole[torch.arange(len(lengths)), last].unsqueeze(1)  # (B, 1, H*D)
    if c_kernel:
        assert torch.equal(at_last, want)
    else:
        assert (at_last - want).abs().max().item() <= 1e-6


def _values(cache: DecodeCache, layer: int, slot: int, length: int) -> Tensor:
    rows = cache.rows(torch.tensor([slot]), torch.arange(length).view(1, -1)).view(-1)
    return cache.values[layer][rows].float()  # (L, H, D)


def test_prefill_writes_the_next_positions_values() -> None:
    """The first LSH layer (layer 1, after a local layer) sees the same input in a plain model with the same
    weights: its successor head's slot s holds the plain slot s+1, and 0 at each prompt's last position."""
    layers = ["local", "lsh", "local", "lsh"]
    lm, plain = _model([1, 2], attn_layers=layers), _model(0, attn_layers=layers)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 258, (n,), generator=g) for n in (150, 37, 5)]
    caches = [DecodeCache.for_tokens(m, 160, slots=7) for m in (lm, plain)]
    logits, states = prefill(lm, caches[0], prompts)
    _, plain_states = prefill(plain, caches[1], prompts)
    for p, state, plain_state in zip(prompts, states, plain_states):
        n = p.shape[0]
        got = _values(caches[0], 1, state.slot, n)
        ref = _values(caches[1], 1, plain_state.slot, n)
        assert torch.equal(got[:-1, 0], ref[1:, 0])  # head 0: the next position's value
        assert torch.equal(got[-1, 0], torch.zeros_like(got[-1, 0]))  # the last one waits for the first step
        assert torch.equal(got[:, 1], ref[:, 1])  # head 1 is plain in this layer
        assert not torch.equal(got[:-1, 0], ref[:-1, 0])
    with torch.no_grad():
        for i, p in enumerate(prompts):  # the logits after each prompt are the forward's
            assert (lm(p[None]).logits[0, -1] - logits[i]).abs().max().item() <= 1e-5
