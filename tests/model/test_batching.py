"""Padding and batching never change a sequence's result (<= 1e-5), and the forward is deterministic."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM

from .helpers import random_ids, tiny_config


def _batch(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def test_logits_alone_padded_and_batched_agree() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(initializer_range=0.3, num_hashes=4, local_attn_chunk_length=16)).eval()
    lengths = [3, 8, 16, 17, 31, 64, 90, 128]
    seqs = [random_ids(1, n, seed=n)[0] for n in lengths]
    ids, mask = _batch(seqs)
    with torch.no_grad():
        batched = lm(ids, mask).logits
        for i, s in enumerate(seqs):
            alone = lm(s[None]).logits[0]
            padded = lm(torch.nn.functional.pad(s, (0, 40))[None],
                        torch.nn.functional.pad(torch.ones_like(s), (0, 40))[None]).logits[0, : len(s)]
            assert (batched[i, : len(s)] - alone).abs().max().item() <= 1e-5, len(s)
            assert (padded - alone).abs().max().item() <= 1e-5, len(s)


def test_embeddings_batch_invariant_and_normalised() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config()).eval()
    seqs = [random_ids(1, n, seed=n)[0] for n in (5, 40, 77)]
    ids, mask = _batch(seqs)
    for pooling in ("mean", "last"):
        batched = lm.embed(ids, mask, pooling=pooling, normalize=True)
        assert torch.allclose(batched.norm(dim=-1), torch.ones(3), atol=1e-6)
        for i, s in enumerate(seqs):
            alone = lm.embed(s[None], pooling=pooling, normalize=True)[0]
            assert (batched[i] - alone).abs().max().item() <= 1e-5
    last = lm.embed(seqs[1][None], pooling="last")[0]
    hidden = lm(seqs[1][None]).hidden_states[0, -1]
    assert torch.allclose(last, hidden)


def test_forward_is_pure_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config()).eval()
    ids = random_ids(2, 96)
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    with torch.no_grad():
        a = lm(ids).logits
        b = lm(ids).logits
    assert torch.rand(1).item() == expected_draw.item()  # no hidden reseeding of the global generator
    assert torch.equal(a, b)


def test_same_weights_and_seed_give_same_model_function() -> None:
    torch.manual_seed(0)
    first = ReformerLM(tiny_config()).eval()
    second = ReformerLM(tiny_config()).eval()
    second.load_state_dict(first.state_dict())
    ids = random_ids(1, 80)
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
    other_seed = ReformerLM(tiny_config(hash_seed=7)).eval()
    other_seed.load_state_dict(first.state_dict())
    with torch.no_grad():
        assert not torch.equal(first(ids).logits, other_seed(ids).logits)


def test_feed_forward_and_head_run_in_chunks() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(chunk_size_feed_forward=16, chunk_size_lm_head=8)).eval()
    unchunked = ReformerLM(tiny_config()).eval()
    unchunked.load_state_dict(lm.state_dict())
    seen: list[int] = []
    lm.layers[0].feed_forward.dense.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    ids = random_ids(1, 64)
    with torch.no_grad():
        assert torch.allclose(lm(ids).logits, unchunked(ids).logits, atol=1e-5)
    assert max(seen) == 16  # the widest intermediate is one chunk, not the sequence


def _pad_rows(seqs: list[torch.Tensor], lefts: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row: `left` padding tokens, the sequence, then right padding up to `total`."""
    ids = torch.full((len(seqs), total), 7, dtype=torch.long)  # padding ids are not pad_token_id on purpose
    mask = torch.zeros_like(ids)
    for i, (s, left) in enumerate(zip(seqs, lefts, strict=True)):
        ids[i, left : left + len(s)] = s
        mask[i, left : left + len(s)] = 1
    return ids, mask


def test_left_right_and_both_padding_give_each_row_its_result_alone() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(num_hashes=4, local_attn_chunk_length=16)).eval()
    lengths = [3, 9, 30, 17, 64, 101]
    lefts = [0, 5, 40, 3, 60, 0]  # right padding only, left only, both, ...
    total = max(n + left for n, left in zip(lengths, lefts, strict=True)) + 4
    seqs = [random_ids(1, n, seed=n)[0] for n in lengths]
    ids, mask = _pad_rows(seqs, lefts, total)
    with torch.no_grad():
        out = lm(ids, mask)
        for i, (s, left) in enumerate(zip(seqs, lefts, strict=True)):
            alone = lm(s[None])
            real = slice(left, left + len(s))
            assert (out.logits[i, real] - alone.logits[0]).abs().max().item() <= 1e-5, (len(s), left)
            assert (out.hidden_states[i, real] - alone.hidden_states[0]).abs().max().item() <= 1e-5
        for pooling in ("mean", "last"):
            pooled = lm.embed(ids, mask, pooling=pooling)
            for i, s in enumerate(seqs):
                assert (pooled[i] - lm.embed(s[None], pooling=pooling)[0]).abs().max().item() <= 1e-5


def test_mask_with_a_hole_is_refused_naming_the_row() -> None:
    lm = ReformerLM(tiny_config()).eval()
    ids = random_ids(3, 12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: fine
    mask[2, 5] = 0  # a hole between real tokens
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask row 2 has padding between real tokens"):
        lm(ids, mask)


def test_fused_attention_is_a_constructor_choice_with_the_same_function() -> None:
    torch.manual_seed(0)
    fused = ReformerLM(tiny_config(num_hashes=4)).eval()
    plain = ReformerLM(tiny_config(num_hashes=4), fused_attention=False).eval()
    plain.load_state_dict(fused.state_dict())
    assert all(layer.attention.self_attention.fused is False for layer in plain.layers)
    ids = random_ids(2, 90)
    with torch.no_grad():
        assert (fused(ids).logits - plain(ids).logits).abs().max().item() <= 1e-4  # float rounding only
