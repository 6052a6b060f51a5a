"""The LSH indexes' recent order is sized for the longest request a cache serves
(model/decoding/lsh_index.py `recent_size_for`): merging it into the main order less often changes no logit."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding import DecodeCache
from model.decoding.lsh_index import MAX_RECENT, RECENT, recent_size_for

from ..helpers import decode_greedily, tiny_config


@pytest.mark.parametrize(("max_tokens", "size"), [
    (None, RECENT), (1, RECENT), (4_096, RECENT), (16_384, 128), (65_536, 256), (524_288, 1_024),
    (10**8, MAX_RECENT)])
def test_the_recent_order_grows_as_the_root_of_the_longest_request(max_tokens: int | None, size: int) -> None:
    assert recent_size_for(max_tokens) == size


def test_a_cache_for_long_requests_takes_the_larger_recent_order() -> None:
    lm = ReformerLM(tiny_config(attn_layers=["local", "lsh"], max_position_embeddings=65_536,
                                axial_pos_shape=[256, 256]))
    cache = DecodeCache(lm, 1 << 22, 2)
    index = cache.indexes[1]
    assert index is not None and index.recent_size == 256


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["c", "torch"])
def test_merging_every_4_or_every_64_steps_gives_the_same_logits(cpu_kernel: bool) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["local", "lsh", "lsh"], num_buckets=8,
                                num_hashes=2)).eval()
    run = [decode_greedily(lm, [7, 40], 70, cpu_kernel=cpu_kernel, recent=r, seed=11) for r in (4, 64)]
    assert torch.equal(run[0], run[1])
