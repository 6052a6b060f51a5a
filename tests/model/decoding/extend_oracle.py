"""The oracle of the extend tests (test_extend.py, test_extend_all_logits.py): a request fed one decode step per
token, and what a request holds in the decode cache, read out so that two caches built alike can be compared
with `torch.equal`; and the token ids both draw (their models and thread setting: conftest.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, DecodeState, prefill
from model.decoding.extend import open_indexes
from model.kernels.weights import WeightKind

VOCAB = 258


def ids(n: int, seed: int) -> list[int]:
    """n seeded token ids of the tiny models' vocabulary."""
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def start(lm: ReformerLM, tokens: int, prompt: Sequence[int], recent: int, slots: int = 1,
          weights: WeightKind = "float32", cpu_kernel: bool = True
          ) -> tuple[DecodeCache, Decoder, DecodeState, Tensor | None]:
    """A decode cache for `tokens` positions a request (`cpu_kernel` False: no C kernels, as on a GPU), its
    decoder (its C products' `weights`), and a request holding `prompt` (prefilled; none: an empty request,
    its indexes opened) with the prefill's logits."""
    cache = DecodeCache.for_tokens(lm, tokens, slots=slots, recent=recent, cpu_kernel=cpu_kernel)
    decoder = Decoder(lm, cache, weights)
    if prompt:
        first, states = prefill(lm, cache, [torch.tensor(list(prompt))], [tokens])
        return cache, decoder, states[0], first[0]
    state = cache.allocate(tokens)
    open_indexes(decoder, state)
    return cache, decoder, state, None


def step_each(decoder: Decoder, state: DecodeState, tokens: Sequence[int]) -> Tensor:
    """The reference: one decode step per token; the logits after the last."""
    logits = None
    for token in tokens:
        logits = decoder.step([int(token)], [state])[0]
    assert logits is not None
    return logits


def held(cache: DecodeCache, state: DecodeState) -> dict[str, Tensor]:
    """Every cached tensor's part the request holds: its positions' keys, values and key factors in the block
    pools, its ring rows in the local layers' pools (those of positions still in the ring), each LSH index's
    counts, its whole recent arrays and its main order's sorted indices, and its state's lengths. (The rest of
    a pool is other requests' or never written: `empty`, not comparable.)"""
    out: dict[str, Tensor] = {"length": torch.tensor([state.length, *state.index_len])}
    length, slot = state.length, state.slot
    rows = cache.slot_rows(state, 0, length)
    for li, index in enumerate(cache.indexes):
        if index is None:  # a local layer's ring
            width = cache.ring.width
            ring = cache.ring.rows(torch.tensor([slot]), torch.arange(max(length - width, 0), length).view(1, -1))
            out[f"{li}.keys"] = cache.keys[li][ring.view(-1)]
            out[f"{li}.values"] = cache.values[li][ring.view(-1)]
            continue
        norms = cache.norms[li]
        assert norms is not None
        out[f"{li}.keys"], out[f"{li}.values"] = cache.keys[li][rows], cache.values[li][rows]
        out[f"{li}.norms"] = norms[rows]
        out[f"{li}.main_counts"] = index.main_counts[slot].clone()
        out[f"{li}.recent_counts"] = index.recent_counts[slot].clone()
        out[f"{li}.recent"] = index.recent[slot].clone()
        out[f"{li}.order"] = index.order[rows[: state.index_len[li]]]
        out[f"{li}.buckets"] = torch.tensor([-1 if state.num_buckets[li] is None else 1])
    return out


def differences(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """The names whose tensors are not `torch.equal` (empty: the same bits... up to the sign of a zero, which
    `torch.equal` does not tell apart; `same_bits` does)."""
    assert a.keys() == b.keys()
    return [k for k in a if not same_bits(a[k], b[k])]


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal shapes and dtypes and equal bits (a float's sign of zero and NaN payload included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)
