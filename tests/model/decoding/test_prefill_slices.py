"""Sliced prefill attention (model/decoding/prefill/slices.py) computes exactly the bits of the full forward's layer
(`torch.equal`), for local and LSH layers, padded batches of mixed lengths, lengths that are not a multiple
of the chunk, both window kernels (fused and plain); prefill through `prefill_steps` equals `prefill`."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import Tensor

from model import ReformerLM
from model.decoding import DecodeCache, prefill, prefill_steps
from model.decoding.prefill.slices import attention_slices, layer_f_slices

from ..helpers import tiny_config
from .layer_inputs import layer_inputs


def _drain(gen: Generator[None, None, Any]) -> tuple[Any, int]:
    """Run a slice generator to its end: (its result, how many times it yielded)."""
    count = 0
    while True:
        try:
            next(gen)
            count += 1
        except StopIteration as done:
            return done.value, count


def _model(**overrides: Any) -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, **overrides)).eval()


def _layer(lm: ReformerLM, i: int) -> Any:
    return lm.layers[i]



LENGTHS = [[200], [203], [131, 200, 77], [5, 150], [3, 8], [64], [9, 9]]


@pytest.mark.parametrize("kind", ["local", "lsh"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["-".join(map(str, x)) for x in LENGTHS])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("slice_chunks", [1, 3, 1000])
def test_sliced_layer_equals_the_full_layer(kind: str, lengths: list[int], fused: bool, slice_chunks: int) -> None:
    lm = _model(attn_layers=[kind, kind], num_hashes=3)
    layer = _layer(lm, 1)
    layer.attention.self_attention.fused = fused
    x, ctx = layer_inputs(lm, lengths)
    with torch.no_grad():
        whole, _ = layer.f(x, ctx, None)
        sliced, yields = _drain(layer_f_slices(layer, x, ctx, slice_chunks))
    assert sliced.shape == whole.shape
    assert torch.equal(sliced, whole)
    if max(lengths) > 4 * lm.config.lsh_attn_chunk_length and slice_chunks == 1:
        assert yields > 4  # actually cut up: more than one slice per head


def test_slices_are_bounded_in_window_attentions() -> None:
    """A slice holds at most `slice_chunks` window attentions: the count of yields grows as it shrinks."""
    lm = _model(attn_layers=["lsh"], num_hashes=2)
    att = _layer(lm, 0).attention.self_attention
    x, ctx = layer_inputs(lm, [256])  # 32 chunks per round, 2 rounds, 2 heads: 128 window attentions
    counts = []
    with torch.no_grad():
        h = _layer(lm, 0).attention.layer_norm(x)
        for size in (8, 32, 128):
            _, yields = _drain(attention_slices(att, h, ctx, size))
            counts.append(yields)
    # one yield after each projection, the hashing and the sort, then per head ceil(64 / size) attention
    # slices and as many slices combining the rounds (size * 8 / 2 positions each: as many rows as an
    # attention slice's queries); at 128 both heads' 64 fit in one slice, which takes them together
    assert counts == [4 + 2 * (8 + 8), 4 + 2 * (2 + 2), 4 + 1 + 1]


def test_training_mode_is_not_sliced() -> None:
    lm = _model(attn_layers=["lsh"]).train()
    x, ctx = layer_inputs(lm, [100])
    with torch.no_grad():
        out, yields = _drain(layer_f_slices(_layer(lm, 0), x, ctx, 1))
        whole, _ = _layer(lm, 0).f(x, ctx, None)
    assert yields == 0 and torch.equal(out, whole)


def test_slice_size_must_be_positive() -> None:
    lm = _model(attn_layers=["local"])
    x, ctx = layer_inputs(lm, [100])
    with pytest.raises(ValueError):
        _drain(attention_slices(_layer(lm, 0).attention.self_attention, x, ctx, 0))


@pytest.mark.parametrize("layers", [["local", "lsh", "local", "lsh"], ["lsh", "lsh"]])
def test_prefill_steps_equals_prefill(layers: list[str]) -> None:
    lm = _model(attn_layers=layers, chunk_size_feed_forward=16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 258, (n,), generator=g) for n in (150, 37, 99)]
    reserve = [n + 8 for n in (150, 37, 99)]
    cache = DecodeCache.for_tokens(lm, 160, slots=7)
    whole, _ = prefill(lm, cache, prompts, reserve)
    (sliced, _), yields = _drain(prefill_steps(lm, cache, prompts, reserve))
    assert torch.equal(sliced, whole)
    assert yields > 4 * len(layers)  # the attention is cut up, not one piece per layer
    with torch.no_grad():
        for i, p in enumerate(prompts):  # and it is the full forward's result
            assert (lm(p[None]).logits[0, -1] - whole[i]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["local", "lsh"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["-".join(map(str, x)) for x in LENGTHS])
@pytest.mark.parametrize("fused,c_kernel", [(True, True), (True, False), (False, False)],
                         ids=["c-kernel", "flash", "plain"])
def test_attention_at_the_last_positions_equals_the_full_attention_there(
        kind: str, lengths: list[int], fused: bool, c_kernel: bool) -> None:
    """`only`: what a prefill's last layer computes (each row's output at its last position); an LSH layer
    over rows longer than a chunk attends only the chunks holding those positions. Same values as the whole
    attention picked there (bit for bit on the C kernel, which computes each chunk alone)."""
    lm = _model(attn_layers=[kind, kind], num_hashes=3)
    att = _layer(lm, 1).attention.self_attention
    att.fused, att.c_kernel = fused, c_kernel
    x, ctx = layer_inputs(lm, lengths)
    last = torch.tensor(lengths) - 1
    with torch.no_grad():
        whole, _ = _drain(attention_slices(att, x, ctx, 3))
        at_last, _ = _drain(attention_slices(att, x, ctx, 3, only=last))
    want = whole[torch.arange(len(lengths)), last].unsqueeze(1)  # (B, 1, H*D)
    assert at_last.shape == want.shape
    if c_kernel:
        assert torch.equal(at_last, want)
    else:
        assert (at_last - want).abs().max().item() <= 1e-6


def test_last_position_attention_runs_one_chunk_per_head_and_round(monkeypatch: pytest.MonkeyPatch) -> None:
    from model.decoding.prefill import lsh_windows as prefill_lsh

    lm = _model(attn_layers=["lsh", "lsh"], num_hashes=3)
    att = _layer(lm, 1).attention.self_attention
    x, ctx = layer_inputs(lm, [200, 131])
    seen: list[int] = []
    real = prefill_lsh.fused_lsh_attend

    def count(q: Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(q.shape[0] * q.shape[1] * q.shape[2])  # window attentions: rows x heads x chunks
        return real(q, *args, **kwargs)

    monkeypatch.setattr(prefill_lsh, "fused_lsh_attend", count)
    with torch.no_grad():
        _drain(attention_slices(att, x, ctx, 3, only=torch.tensor([199, 130])))
    assert sum(seen) == 2 * att.heads * att.rounds
