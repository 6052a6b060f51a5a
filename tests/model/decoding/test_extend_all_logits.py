"""Extend with every token's logits (model/decoding/extend.py `extend(all_logits=True)`, what prompt scoring under
the causal prefill reads): row t is, bit for bit, the logits the decode step that reads token t returns, on the
C path (the last layer attends, and the final layer norm and the LM head run, on every row: extend_layers.c
`all_rows`) and on the reference path (the steps' logits stacked); the cache it leaves is the default extend's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from model import ReformerLM
from model.decoding import Decoder, DecodeState
from model.decoding import extend as extend_module
from model.decoding.extend import c_path
from model.kernels.weights import WeightKind

from ..helpers import tiny_config
from .extend_oracle import VOCAB, differences, held, ids, same_bits, start

# one intra-op thread unless a test sets more (test_one_thread_equals_two): on two cores shared with other work, a
# second thread waits at the C call's per-row barriers for a busy core
pytestmark = pytest.mark.usefixtures("one_thread")


def step_rows(decoder: Decoder, state: DecodeState, tokens: Sequence[int]) -> Tensor:
    """The reference: one decode step per token, every step's logits stacked (S, vocab)."""
    return torch.stack([decoder.step([int(token)], [state])[0] for token in tokens])


def _check(lm: ReformerLM, prompt: list[int], tokens: list[int], recent: int, pieces: list[int] | None = None,
           weights: WeightKind = "float32", cpu_kernel: bool = True, in_c: bool = True) -> None:
    """All-rows extends (in `pieces`, default one) = the steps' logits row by row; the cache left = the steps'
    and the default extend's."""
    room = len(prompt) + len(tokens) + 1
    ref_cache, ref_decoder, ref_state, _ = start(lm, room, prompt, recent, weights=weights, cpu_kernel=cpu_kernel)
    cache, decoder, state, _ = start(lm, room, prompt, recent, weights=weights, cpu_kernel=cpu_kernel)
    last_cache, last_decoder, last_state, _ = start(lm, room, prompt, recent, weights=weights, cpu_kernel=cpu_kernel)
    assert c_path(decoder) == in_c
    want = step_rows(ref_decoder, ref_state, tokens)
    got, at = [], 0
    for n in pieces or [len(tokens)]:
        got.append(decoder.extend(state, tokens[at : at + n], all_logits=True))
        last = last_decoder.extend(last_state, tokens[at : at + n])
        assert got[-1].shape == (n, lm.config.vocab_size)
        assert same_bits(got[-1][-1], last)  # its last row is the default extend's logits
        at += n
    assert at == len(tokens)
    rows = torch.cat(got)
    bad = [t for t in range(len(tokens)) if not same_bits(rows[t], want[t])]
    assert bad == []
    assert differences(held(cache, state), held(ref_cache, ref_state)) == []
    assert differences(held(cache, state), held(last_cache, last_state)) == []


@pytest.mark.parametrize("prompt_len", [0, 5, 40], ids=["empty", "shorter-than-a-chunk", "prefilled"])
@pytest.mark.parametrize("size", [1, 2, 7, 9, 65, 300])
def test_tiny_all_rows_equal_steps_across_merges(tiny: ReformerLM, prompt_len: int, size: int) -> None:
    """Recent orders of 8 items: a 300-token extend merges each LSH index 37 times on the way."""
    _check(tiny, ids(prompt_len, 1), ids(size, 2), recent=8)


@pytest.mark.parametrize(("prompt_len", "size"), [(0, 64), (10, 300), (200, 1024)])
def test_shipped_all_rows_equal_steps(shipped: ReformerLM, prompt_len: int, size: int) -> None:
    _check(shipped, ids(prompt_len, 3), ids(size, 4), recent=64)


def test_shipped_all_rows_in_pieces(shipped: ReformerLM) -> None:
    """Slices as the service reads a scored prompt: each slice's rows are the steps' rows."""
    _check(shipped, [], ids(700, 5), recent=64, pieces=[1, 63, 300, 336])


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_all_rows_on_reduced_weights(shipped: ReformerLM, weights: WeightKind) -> None:
    _check(shipped, ids(70, 24), ids(150, 25), recent=64, weights=weights)


@pytest.mark.parametrize("layers", [["local", "local"], ["lsh", "lsh"], ["lsh", "local"]],
                         ids=["local-only", "lsh-only", "local-last"])
def test_models_of_other_layers(layers: list[str]) -> None:
    """No LSH layer, no local layer, and a local last layer with heads of 32 (extend_local.c's shared copy)."""
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=VOCAB, attn_layers=layers, attention_head_size=32,
                                num_buckets=None if "lsh" not in layers else 8)).eval()
    _check(lm, ids(11, 26), ids(200, 27), recent=8)


def test_split_into_calls(tiny: ReformerLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """EXTEND_ROWS cuts a long extend into C calls: every call's rows, in order."""
    monkeypatch.setattr(extend_module, "EXTEND_ROWS", 50)
    _check(tiny, ids(3, 17), ids(230, 18), recent=8)


@pytest.mark.parametrize("model", ["shipped", "tiny"])
def test_one_thread_equals_two(model: str, request: pytest.FixtureRequest) -> None:
    """Two threads split the heads and the products' panels: every row's logits the same bits as one thread's."""
    lm = request.getfixturevalue(model)
    prompt, tokens = ids(100, 15), ids(700, 16)
    recent = 64 if model == "shipped" else 3
    out = []
    for n in (1, 2):
        torch.set_num_threads(1)
        cache, decoder, state, _ = start(lm, 1000, prompt, recent=recent)
        torch.set_num_threads(n)
        out.append((decoder.extend(state, tokens, all_logits=True), held(cache, state)))
    assert same_bits(out[0][0], out[1][0])
    assert differences(out[0][1], out[1][1]) == []


@pytest.mark.parametrize("where", ["automatic-bucket-counts", "pytorch-step"])
def test_the_reference_path(where: str) -> None:
    """Where the C call does not run: the steps' logits, stacked."""
    torch.manual_seed(0)
    automatic = where == "automatic-bucket-counts"
    lm = ReformerLM(tiny_config(vocab_size=VOCAB, num_buckets=None if automatic else 8)).eval()
    _check(lm, ids(6, 19), ids(80, 20), recent=8, cpu_kernel=automatic, in_c=False)


def test_the_rows_are_each_rows_own(tiny: ReformerLM) -> None:
    """The flag is not ignored: the rows differ from each other and from a copy of the last row (a C call that
    wrote the last row only would leave the others unwritten, or the last row's)."""
    cache, decoder, state, _ = start(tiny, 100, ids(5, 40), recent=8)
    rows = decoder.extend(state, ids(30, 41), all_logits=True)
    assert rows.shape == (30, VOCAB) and bool(torch.isfinite(rows).all())
    assert all(not torch.equal(rows[t], rows[-1]) for t in range(29))
    assert len({tuple(r.tolist()) for r in rows}) == 30
