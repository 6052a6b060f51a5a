"""Extend (model/decoding/extend.py) leaves exactly what one decode step per token leaves: the same logits after
the last token and the same bits in every cached tensor the request holds (extend_oracle.held), whatever the
segmentation, the other requests in the cache and the thread count; on the C path (one C call) and on the
reference path (the steps)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import ReformerLM
from model.decoding import extend as extend_module
from model.decoding.extend import c_path
from model.kernels.weights import WeightKind

from ..helpers import tiny_config
from .extend_oracle import VOCAB, differences, held, ids, same_bits, start, step_each

# one intra-op thread unless a test sets more (test_one_thread_equals_two): on two cores shared with other work, a
# second thread waits at the C call's per-row barriers for a busy core
pytestmark = pytest.mark.usefixtures("one_thread")


def _check(lm: ReformerLM, prompt: list[int], tokens: list[int], recent: int, pieces: list[int] | None = None,
           weights: WeightKind = "float32") -> None:
    """Extend (in `pieces` of these lengths, one extend each; default one piece) against one step per token,
    the C products reading `weights`."""
    room = len(prompt) + len(tokens) + 1
    ref_cache, ref_decoder, ref_state, _ = start(lm, room, prompt, recent, weights=weights)
    cache, decoder, state, _ = start(lm, room, prompt, recent, weights=weights)
    assert c_path(decoder) and decoder.describe()["decode_weights"] == weights
    want = step_each(ref_decoder, ref_state, tokens)
    at = 0
    for n in pieces or [len(tokens)]:
        got = decoder.extend(state, tokens[at : at + n])
        at += n
    assert at == len(tokens)
    assert same_bits(got, want)
    assert differences(held(cache, state), held(ref_cache, ref_state)) == []


@pytest.mark.parametrize("prompt_len", [0, 5, 40], ids=["empty", "shorter-than-a-chunk", "prefilled"])
@pytest.mark.parametrize("size", [1, 7, 8, 9, 63, 64, 65, 300])
def test_tiny_extend_equals_steps_across_merges(tiny: ReformerLM, prompt_len: int, size: int) -> None:
    """Recent orders of 8 items: a 300-token extend merges each LSH index 37 times on the way."""
    _check(tiny, ids(prompt_len, 1), ids(size, 2), recent=8)


# every size from each prompt; 4,096 tokens (whose steps take about a second) from the prefilled prompt only
SHIPPED_CASES = [(p, s) for p in (0, 10, 200) for s in (1, 63, 64, 65, 300, 1024)] + [(200, 4096)]


@pytest.mark.parametrize(("prompt_len", "size"), SHIPPED_CASES, ids=[f"prompt{p}-extend{s}" for p, s in SHIPPED_CASES])
def test_shipped_extend_equals_steps(shipped: ReformerLM, prompt_len: int, size: int) -> None:
    _check(shipped, ids(prompt_len, 3), ids(size, 4), recent=64)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_extend_equals_steps_on_reduced_weights(shipped: ReformerLM, weights: WeightKind) -> None:
    """The C products on bfloat16 or int8 weights (REFORMER_DECODE_WEIGHTS) are row-independent too."""
    _check(shipped, ids(70, 24), ids(300, 25), recent=64, weights=weights)


@pytest.mark.parametrize("layers", [["local", "local"], ["lsh", "lsh"]])
def test_models_of_one_kind_of_layer(layers: list[str]) -> None:
    """No LSH layer (no bucket count at all), or no local layer."""
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=VOCAB, attn_layers=layers,
                                num_buckets=None if "lsh" not in layers else 8)).eval()
    _check(lm, ids(11, 26), ids(90, 27), recent=8)


def test_two_extends_equal_one(tiny: ReformerLM) -> None:
    """extend(A + B) = extend(A) then extend(B), both = the steps."""
    tokens = ids(150, 5)
    _check(tiny, ids(12, 6), tokens, recent=8, pieces=[61, 89])
    _check(tiny, ids(12, 6), tokens, recent=8, pieces=[150])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_segmentation_equals_steps(tiny: ReformerLM, data: st.DataObject) -> None:
    prompt_len = data.draw(st.integers(0, 20), label="prompt")
    pieces = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6), label="pieces")
    _check(tiny, ids(prompt_len, 7), ids(sum(pieces), 8), recent=data.draw(st.sampled_from([3, 8, 64])),
           pieces=pieces)


def test_other_requests_change_nothing(tiny: ReformerLM) -> None:
    """A request extended alone = the same request extended while two other slots hold requests that step and
    extend between its extends."""
    prompt, tokens = ids(9, 10), ids(120, 11)
    alone_cache, alone_decoder, alone, _ = start(tiny, 200, [], recent=8)
    for part in (prompt, tokens[:50], tokens[50:]):
        alone_logits = alone_decoder.extend(alone, part)
    busy_cache, busy_decoder, first, _ = start(tiny, 200, ids(30, 12), recent=8, slots=3)
    second = busy_cache.allocate(200)
    busy_decoder.extend(second, ids(17, 13))
    target = busy_cache.allocate(200)
    busy_decoder.extend(target, prompt)
    busy_decoder.extend(target, tokens[:50])
    busy_decoder.step([5, 6], [first, second])
    busy_decoder.extend(first, ids(33, 14))
    busy_logits = busy_decoder.extend(target, tokens[50:])
    assert target.slot != alone.slot  # the rows it reads and writes are other rows
    assert same_bits(busy_logits, alone_logits)
    assert differences(held(busy_cache, target), held(alone_cache, alone)) == []


@pytest.mark.parametrize("model", ["shipped", "tiny"])
def test_one_thread_equals_two(model: str, request: pytest.FixtureRequest) -> None:
    """Two threads split the heads (each merges, writes, inserts and attends its own): the same bits as one.
    The tiny model with recent orders of 3 merges every 3 rows."""
    lm = request.getfixturevalue(model)
    prompt, tokens = ids(100, 15), ids(700, 16)
    recent = 64 if model == "shipped" else 3
    out = []
    for n in (1, 2):
        torch.set_num_threads(1)  # the prefill on one thread both times: its PyTorch ops' bits may depend on it
        cache, decoder, state, _ = start(lm, 1000, prompt, recent=recent)
        torch.set_num_threads(n)
        out.append((decoder.extend(state, tokens), held(cache, state)))
    assert same_bits(out[0][0], out[1][0])
    assert differences(out[0][1], out[1][1]) == []


def test_long_extends_are_split_into_calls(tiny: ReformerLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extend_module, "EXTEND_ROWS", 50)
    _check(tiny, ids(3, 17), ids(230, 18), recent=8)


@pytest.mark.parametrize("where", ["automatic-bucket-counts", "pytorch-step"])
def test_the_reference_path_runs_where_the_c_call_does_not(where: str) -> None:
    """Automatic bucket counts (indexes rebuilt as the length grows) or no C kernels (the PyTorch step, as on a
    GPU): extend takes the steps, same bits."""
    torch.manual_seed(0)
    automatic = where == "automatic-bucket-counts"
    lm = ReformerLM(tiny_config(vocab_size=VOCAB, num_buckets=None if automatic else 8)).eval()
    prompt, tokens = ids(6, 19), ids(80, 20)
    cache, decoder, state, _ = start(lm, 100, prompt, recent=8, cpu_kernel=automatic)
    assert not c_path(decoder)
    ref_cache, ref_decoder, ref, _ = start(lm, 100, prompt, recent=8, cpu_kernel=automatic)
    assert same_bits(decoder.extend(state, tokens), step_each(ref_decoder, ref, tokens))
    assert differences(held(cache, state), held(ref_cache, ref)) == []


def test_extend_is_not_the_one_piece_prefill(shipped: ReformerLM) -> None:
    """The comparison can tell semantics apart: a 300-token prompt prefilled in one piece (its windows see
    masked later tokens) leaves other logits and keys than the same prompt extended."""
    tokens = ids(300, 21)
    cache, decoder, state, _ = start(shipped, 400, [], recent=64)
    extended = decoder.extend(state, tokens)
    one_cache, _, one_state, prefilled = start(shipped, 400, tokens, recent=64)
    assert prefilled is not None and not same_bits(extended, prefilled)
    diff = differences(held(cache, state), held(one_cache, one_state))
    assert "1.keys" in diff  # the second layer (LSH) reads the first layer's outputs


def test_refusals(tiny: ReformerLM) -> None:
    cache, decoder, state, _ = start(tiny, 20, ids(4, 22), recent=8)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.extend(state, [])
    with pytest.raises(ValueError, match="positions reserved"):
        decoder.extend(state, ids(cache.block_size * state.capacity, 23))
    assert state.length == 4  # nothing done
    cache.free(state)
    with pytest.raises(ValueError, match="freed"):
        decoder.extend(state, [5])


@pytest.mark.parametrize("model", ["shipped", "tiny"])
def test_the_rows_facts_are_the_steps(model: str, request: pytest.FixtureRequest) -> None:
    """The facts extend hands the C call for positions 0 .. 299 (worked out together) = `row_facts` of a step at
    each position."""
    from model.decoding.facts import position_facts, row_facts

    lm = request.getfixturevalue(model)
    _, decoder, state, _ = start(lm, 400, [], recent=64)
    facts = position_facts(lm, decoder.cache, state, 300)
    for t in range(300):
        state.length = t
        assert facts[t].tolist() == row_facts(lm, decoder.cache, [state])[0][0], t


# The windows shared between an extend's rows (model/kernels/csrc/extend_windows.c): every LSH layer but the last
# stores all its rows first, then reads each row's windows from counts as of that row, in blocks of 1,024 rows.


def test_shipped_long_extend_after_a_long_prefix(shipped: ReformerLM) -> None:
    """4,500 rows (two C calls of up to 4,096 rows, five blocks of windows) after 3,000 prefilled positions,
    recent orders of 64: the indexes merge at the first call's first rows and every 64 rows through both calls,
    and windows near the rounds' ends wrap into the round before."""
    _check(shipped, ids(3000, 30), ids(4500, 31), recent=64)


def test_tiny_extend_of_several_blocks(tiny: ReformerLM) -> None:
    """2,600 rows in one call, three blocks of windows, on the tiny model (chunks of 8: a row's window wraps into
    the round before whenever its rank is in a round's first chunk), merging every 8 rows."""
    _check(tiny, ids(30, 32), ids(2600, 33), recent=8)


@pytest.mark.parametrize("before", [7, 8, 9, 16])
def test_extend_right_after_a_merge_boundary(tiny: ReformerLM, before: int) -> None:
    """After a prefilled prompt, an extend of `before` rows leaves the recent orders (8 items) one short of full,
    full (the next extend's first row merges before its write), or just merged; the next extend follows."""
    _check(tiny, ids(20, 34), ids(before + 60, 35), recent=8, pieces=[before, 60])


def test_long_extend_on_two_threads_equals_steps(shipped: ReformerLM) -> None:
    """Two threads (each its own heads' windows, merges and blocks) over 2,500 rows after 1,000 positions = the
    steps on one thread."""
    prompt, tokens = ids(1000, 36), ids(2500, 37)
    ref_cache, ref_decoder, ref, _ = start(shipped, 3600, prompt, recent=64)
    want = step_each(ref_decoder, ref, tokens)
    cache, decoder, state, _ = start(shipped, 3600, prompt, recent=64)
    torch.set_num_threads(2)
    got = decoder.extend(state, tokens)
    assert same_bits(got, want)
    assert differences(held(cache, state), held(ref_cache, ref)) == []


@pytest.mark.parametrize("layers", [["lsh", "local"], ["local", "lsh", "local", "lsh"]],
                         ids=["local-last", "local-lsh"])
def test_heads_of_32_elements(layers: list[str]) -> None:
    """Heads of 32 elements, as the shipped model's: the local layers attend from one copy of their windows
    (model/kernels/csrc/extend_local.c) and the LSH layers' sums run four rows side by side (extend_attend.c);
    a local last layer attends its last row only. Chunks of 8, recent orders of 8."""
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=VOCAB, attention_head_size=32, attn_layers=layers,
                                lsh_successor_heads=1)).eval()
    _check(lm, ids(40, 38), ids(700, 39), recent=8)
