"""Invariant 1: same weights and hash seed as transformers' Reformer -> same logits (<= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from model import ReformerConfig, ReformerLM

from .helpers import random_ids, reference_pair

CASES = [
    ("hashes=1", {"num_hashes": 1}, 64),
    ("hashes=2", {"num_hashes": 2}, 64),
    ("hashes=4", {"num_hashes": 4}, 72),
    ("hashes=8", {"num_hashes": 8}, 64),
    ("buckets=factorised", {"num_buckets": [2, 4], "num_hashes": 4}, 96),
    ("buckets=auto", {"num_buckets": None}, 128),
    ("buckets=auto-factorised", {"num_buckets": None, "max_position_embeddings": 256,
                                 "axial_pos_shape": (16, 16)}, 256),
    ("chunk=4", {"lsh_attn_chunk_length": 4, "local_attn_chunk_length": 4}, 40),
    ("chunk=16/8", {"lsh_attn_chunk_length": 16, "local_attn_chunk_length": 8}, 70),
    ("before=2", {"lsh_num_chunks_before": 2, "local_num_chunks_before": 2}, 64),
    ("before=0", {"lsh_num_chunks_before": 0, "local_num_chunks_before": 0}, 64),
    ("lsh-only", {"attn_layers": ["lsh", "lsh"]}, 48),
    ("local-only", {"attn_layers": ["local", "local", "local"]}, 48),
    ("plain-positions", {"axial_pos_embds": False}, 64),
    ("ff-chunked", {"chunk_size_feed_forward": 16, "chunk_size_lm_head": 8}, 64),
    ("gelu", {"hidden_act": "gelu"}, 64),
    ("encoder-bidirectional", {"is_decoder": False, "lsh_num_chunks_after": 1, "local_num_chunks_after": 1}, 64),
]


@pytest.mark.parametrize("name,overrides,length", CASES, ids=[c[0] for c in CASES])
def test_logits_match_reference(name: str, overrides: dict, length: int) -> None:
    hf, lm = reference_pair(**overrides)
    ids = random_ids(2, length)
    with torch.no_grad():
        expected = hf(ids, use_cache=False).logits
        got = lm(ids).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("length", [1, 5, 8, 9, 15, 16, 17, 63, 100, 257])
def test_lengths_multiple_and_not_of_chunk(length: int) -> None:
    hf, lm = reference_pair()
    ids = random_ids(1, length, seed=length)
    with torch.no_grad():
        diff = (hf(ids, use_cache=False).logits - lm(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_long_sequence_4096() -> None:
    hf, lm = reference_pair(lsh_attn_chunk_length=64, local_attn_chunk_length=64, num_buckets=64, num_hashes=2)
    ids = random_ids(1, 4096)
    with torch.no_grad():
        diff = (hf(ids, use_cache=False).logits - lm(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_padded_batch_matches_reference_on_each_row() -> None:
    """The reference is not padding-invariant (a short row's hash-round wrap lands in padding); ours is,
    and each padded row equals the reference run on that row alone. The longest row equals the reference's
    padded batch too."""
    hf, lm = reference_pair()
    lengths = [100, 37, 64, 5, 16]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = random_ids(1, n, seed=n)[0]
        mask[i, :n] = 1
    with torch.no_grad():
        ours = lm(ids, mask).logits
        theirs_batched = hf(ids, attention_mask=mask, use_cache=False).logits
        for i, n in enumerate(lengths):
            alone = hf(ids[i : i + 1, :n], use_cache=False).logits[0]
            assert (ours[i, :n] - alone).abs().max().item() <= 1e-4
    assert (ours[0] - theirs_batched[0]).abs().max().item() <= 1e-4


def test_config_round_trips_through_transformers() -> None:
    cfg = ReformerConfig(num_buckets=[4, 8], attn_layers=["lsh", "local"], hash_seed=7)
    back = ReformerConfig.from_hf(cfg.to_hf())
    assert back == cfg


def test_hash_seed_none_becomes_deterministic_seed() -> None:
    from transformers import ReformerConfig as HFConfig

    cfg = ReformerConfig.from_hf(HFConfig(hash_seed=None, is_decoder=True))
    assert cfg.hash_seed == 0


def test_from_hf_loads_every_weight() -> None:
    from model.hf import hf_state_dict_to_ours

    hf, lm = reference_pair()
    assert isinstance(lm, ReformerLM)
    ours = lm.state_dict()
    mapped = hf_state_dict_to_ours(hf.state_dict())
    # every reference tensor (but the unused lm_head.bias) lands on a parameter of ours, with its values
    assert set(mapped) == {k for k, _ in lm.named_parameters()}
    assert all(torch.equal(ours[k], v) for k, v in mapped.items())
    assert sum(p.numel() for p in lm.parameters()) == sum(p.numel() for p in hf.parameters()) - 40
