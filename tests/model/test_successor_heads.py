"""Successor-value LSH heads (model/lsh/successor.py) in the forward: the configuration, the contract
(key s contributes v[s+1]; query t attends keys s < t only; a row that sees nothing but itself is 0), no
leak from later tokens, and training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from model import ReformerConfig, ReformerLM
from model.attention import AttentionContext, LSHSelfAttention
from model.lsh.successor import successor_values

from .helpers import random_ids, tiny_config


# ---------------------------------------------------------------------------------------------- config
def test_successor_heads_per_layer() -> None:
    every = tiny_config(lsh_successor_heads=1)
    assert [every.successor_heads(i) for i in range(4)] == [0, 1, 0, 1]
    listed = tiny_config(lsh_successor_heads=[2, 0])
    assert [listed.successor_heads(i) for i in range(4)] == [0, 2, 0, 0]
    assert tiny_config().successor_heads(1) == 0
    with pytest.raises(IndexError):
        every.successor_heads(4)


@pytest.mark.parametrize("counts, message", [
    (3, "from 0 to num_attention_heads"), (-1, "from 0 to num_attention_heads"),
    ([1], "1 counts for 2 LSH layers"), ([1, 2, 0], "3 counts for 2 LSH layers"),
    ([0, 5], "from 0 to num_attention_heads"), (True, "from 0 to num_attention_heads"),
    ([1.0, 0], "from 0 to num_attention_heads"),
])
def test_successor_heads_validation(counts: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(lsh_successor_heads=counts)


def test_successor_heads_round_trip(tmp_path: Path) -> None:
    cfg = tiny_config(lsh_successor_heads=[2, 1])
    assert ReformerConfig.from_dict(cfg.to_dict()) == cfg
    cfg.to_json(tmp_path / "config.json")
    assert ReformerConfig.from_json(tmp_path / "config.json") == cfg
    old = tiny_config().to_dict()
    del old["lsh_successor_heads"]  # a config.json written before the field existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert ReformerConfig.from_json(tmp_path / "old.json").lsh_successor_heads == 0


def test_to_hf_refuses_successor_heads() -> None:
    with pytest.raises(ValueError, match="lsh_successor_heads"):
        tiny_config(lsh_successor_heads=[0, 1]).to_hf()
    tiny_config(lsh_successor_heads=[0, 0]).to_hf()  # all zero: the transformers model is the same


# ---------------------------------------------------------------------------------------------- values
def test_successor_values_shift_and_padding() -> None:
    v = torch.arange(2 * 2 * 4 * 1, dtype=torch.float32).view(2, 2, 4, 1) + 1  # (B, H, L, D)
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    out = successor_values(v, 1, valid)
    assert out[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 0.0]
    assert out[1, 0, :, 0].tolist() == [10.0, 0.0, 0.0, 0.0]  # position 2 is padding: no successor
    assert torch.equal(out[:, 1], v[:, 1])  # a plain head keeps its values
    assert successor_values(v, 0, valid) is v


# ---------------------------------------------------------------------------------------------- the layer
def _layer_pair(successor: int, **overrides: Any) -> tuple[LSHSelfAttention, LSHSelfAttention]:
    """An LSH layer with `successor` successor heads and a plain one with the same weights."""
    torch.manual_seed(3)
    cfg = tiny_config(lsh_successor_heads=successor, **overrides)
    layer = LSHSelfAttention(cfg, layer_index=1).eval()
    plain = LSHSelfAttention(tiny_config(**overrides), layer_index=1).eval()
    plain.load_state_dict(layer.state_dict())
    return layer, plain


def _shift_values(module: nn.Linear, valid: Tensor | None) -> Any:
    """A forward hook making every head of `module` (the value projection) return the next position's
    value, 0 at the last position and where the next position is padding."""
    def hook(_: nn.Module, __: Any, out: Tensor) -> Tensor:
        ahead = torch.cat([out[:, 1:], torch.zeros_like(out[:, :1])], dim=1)  # (B, L, H*D)
        if valid is None:
            return ahead
        next_real = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        return ahead * next_real.unsqueeze(-1)
    return module.register_forward_hook(hook)


def _context(valid: Tensor | None, own: list[int]) -> AttentionContext:
    return AttentionContext(valid=valid, own_length=torch.tensor(own))


@pytest.mark.parametrize("length", [8, 48])  # one chunk (dense) and six chunks (hashed, sorted, chunked)
@pytest.mark.parametrize("mode", ["c_kernel", "flash", "plain", "train"])
def test_successor_heads_are_plain_heads_over_next_values(length: int, mode: str) -> None:
    """All heads successor: wherever a query sees an earlier key, the output is a plain head's over the
    shifted values (a plain head gives its own position -1e5: nothing once another key is seen); a row that
    sees only itself is exactly 0, where the plain head returns its own (shifted) value."""
    layer, plain = _layer_pair(2)
    for m in (layer, plain):
        m.c_kernel = mode == "c_kernel"
        m.fused = mode in ("c_kernel", "flash")
        m.train(mode == "train")
    x = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(length))
    valid = torch.ones(2, length, dtype=torch.bool)
    valid[1, length - 3:] = False  # the second row has padding at its end
    ctx = _context(valid, [length, length])
    with torch.set_grad_enabled(mode == "train"):
        got, _ = layer(x, ctx)
        handle = _shift_values(plain.value, valid)
        want, _ = plain(x, ctx)
        handle.remove()
        v = plain.value(x)
    nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1) * torch.cat(
        [valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1).unsqueeze(-1)  # (B, L, H*D)
    got, want, nxt = (t.detach().view(2, length, 2, 16) for t in (got, want, nxt))  # (B, L, H, D)
    zero = (got == 0).all(dim=-1) & valid.unsqueeze(-1)  # (B, L, H): real queries the heads zeroed
    seen = ~zero & valid.unsqueeze(-1)
    assert zero[:, 0].all(), "the first position sees nothing but itself"
    # rows the successor heads zeroed are the rows where the plain head saw only itself (its self logit of
    # -1e5 leaves a log-sum-exp rounded at that magnitude: the reference's output is 0.998 x its value)
    assert torch.allclose(want[zero], nxt[zero], rtol=1e-2, atol=1e-5)
    assert torch.allclose(got[seen], want[seen], atol=1e-5)
    assert seen.float().sum() > 0.5 * valid.sum() * 2  # most rows see earlier keys


@pytest.mark.parametrize("length", [8, 48])
def test_plain_heads_of_a_successor_layer_unchanged(length: int) -> None:
    layer, plain = _layer_pair(1)
    x = torch.randn(1, length, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, _ = layer(x, _context(None, [length]))
        want, _ = plain(x, _context(None, [length]))
    assert torch.equal(got[..., 16:], want[..., 16:])  # head 1 is plain: bit for bit
    assert not torch.allclose(got[..., :16], want[..., :16])


def test_zero_successor_heads_is_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = ReformerLM(tiny_config()).eval()
    torch.manual_seed(0)
    zeros = ReformerLM(tiny_config(lsh_successor_heads=[0, 0])).eval()
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(zeros(ids).logits, plain(ids).logits)


# ---------------------------------------------------------------------------------------------- no leak
@contextmanager
def _fixed_buckets(lm: ReformerLM) -> Iterator[None]:
    """Each LSH layer hashes on the first forward and replays those buckets afterwards: later tokens then
    cannot move the sorted chunks' boundaries (which every Reformer's full forward lets them do)."""
    saved: dict[int, Tensor] = {}
    layers = [m for m in lm.modules() if isinstance(m, LSHSelfAttention)]
    originals = [layer._hash_rows for layer in layers]

    def replay(i: int, original: Any) -> Any:
        def hash_rows(qk: Tensor, ctx: AttentionContext) -> Tensor:
            if i not in saved:
                saved[i] = original(qk, ctx)
            return saved[i]
        return hash_rows

    for i, layer in enumerate(layers):
        layer._hash_rows = replay(i, originals[i])  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer, original in zip(layers, originals):
            layer._hash_rows = original  # type: ignore[method-assign]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("length", [8, 64])
def test_no_leak_from_later_tokens(train: bool, length: int) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(lsh_successor_heads=[2, 1])).train(train)
    ids = random_ids(1, length, seed=7)
    cut = length // 2
    later = ids.clone()
    later[0, cut + 1:] = random_ids(1, length - cut - 1, seed=8)[0]
    with _fixed_buckets(lm), torch.set_grad_enabled(train):
        before = lm(ids).logits
        after = lm(later).logits
    assert torch.equal(before[:, : cut + 1], after[:, : cut + 1])
    assert not torch.allclose(before[:, cut + 1:], after[:, cut + 1:])


def test_without_zeroing_the_self_only_row_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: with self-only rows left to the softmax over masked keys, position 0 reads
    its window's successor values, which hold later tokens."""
    import model.attention as attention

    monkeypatch.setattr(attention, "zero_rows_without_keys", lambda out, lse, heads: out)
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(lsh_successor_heads=2)).eval()
    ids = random_ids(1, 8, seed=7)
    later = ids.clone()
    later[0, 1] = (ids[0, 1] + 1) % 40
    with torch.no_grad():
        assert not torch.equal(lm(ids).logits[:, 0], lm(later).logits[:, 0])


# ---------------------------------------------------------------------------------------------- batches, training
def test_padded_batch_rows_equal_rows_alone() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(lsh_successor_heads=[1, 2])).eval()
    a, b = random_ids(1, 40, seed=2), random_ids(1, 23, seed=3)
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, :23], mask[1, :23] = b[0], 1
    with torch.no_grad():
        both = lm(ids, attention_mask=mask).logits
        assert torch.allclose(both[0], lm(a).logits[0], atol=1e-4)
        assert torch.allclose(both[1, :23], lm(b).logits[0], atol=1e-4)


def test_gradients_flow_and_reversible_matches_autograd() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(lsh_successor_heads=[2, 1])).train()
    ids = random_ids(2, 64, seed=4)
    grads = []
    for reversible in (True, False):
        lm.reversible = reversible
        lm.zero_grad()
        logits = lm(ids).logits
        nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
    value = grads[0]["layers.1.attention.self_attention.value.weight"]
    assert value.abs().sum() > 0 and torch.isfinite(value).all()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        # the reversible backward recomputes the forward: rounding differs (as much with no successor heads)
        scale = float(grads[1][name].abs().max())
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-3 * scale, rtol=0), name
