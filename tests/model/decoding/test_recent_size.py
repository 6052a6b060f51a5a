"""The LSH indexes' recent order is sized for the longest request a cache serves
(model/decoding/lsh_index.py `recent_size_for`): merging it into the main order less often changes no logit."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from model.decoding.lsh_index import MAX_RECENT, RECENT, recent_size_for

from ..helpers import tiny_config


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


def _decode(lm: ReformerLM, recent: int, cpu_kernel: bool) -> torch.Tensor:
    lengths, steps = [7, 40], 70
    cache = DecodeCache.for_tokens(lm, max(lengths) + steps + 1, slots=len(lengths), recent=recent,
                                   cpu_kernel=cpu_kernel)
    decoder = Decoder(lm, cache)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, lm.config.vocab_size, (n,), generator=g) for n in lengths]
    out = []
    with torch.no_grad():
        first, states = prefill(lm, cache, prompts, [n + steps + 1 for n in lengths])
        token = first.argmax(-1)
        for _ in range(steps):
            logits = decoder.step(token, states)
            out.append(logits)
            token = logits.argmax(-1)
    return torch.stack(out)


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["c", "torch"])
def test_merging_every_4_or_every_64_steps_gives_the_same_logits(cpu_kernel: bool) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["local", "lsh", "lsh"], num_buckets=8,
                                num_hashes=2)).eval()
    assert torch.equal(_decode(lm, 4, cpu_kernel), _decode(lm, 64, cpu_kernel))
