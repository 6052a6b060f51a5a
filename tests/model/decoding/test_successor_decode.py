"""Successor-value heads in cached decoding (model/lsh/successor.py): a successor head's value slot s holds
v[s+1], written one step late, and the new position attends earlier positions only. On every decode path
(the PyTorch step, the per-layer C path, the fused C step, bfloat16/int8 decode weights, half-precision
pools): cached decoding equals the forward over the truncated prefix for models whose LSH layers are fed by
local layers only (so the cached keys and values are exactly the forward's), the C paths equal the PyTorch
one, a row that can attend only itself gives exactly 0 in those heads, and no step reads a later token."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from model.kernels import CpuKernels

from ..helpers import tiny_config

# one intra-op thread, as a decode step of a few rows runs (tests/model/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = ["fused", "c-per-layer", "torch"]


def _model(layers: list[str], successor: int | list[int], hashes: int = 2, seed: int = 0) -> ReformerLM:
    torch.manual_seed(seed)
    return ReformerLM(tiny_config(attn_layers=layers, num_hashes=hashes, vocab_size=258, initializer_range=0.3,
                                  lsh_successor_heads=successor)).eval()


def _decoder(lm: ReformerLM, tokens: int, path: str, weights: str = "float32", slots: int = 1,
             kv_dtype: torch.dtype | None = None) -> Decoder:
    """A decoder on one of the decode paths: the one-call C step, the per-layer step with C windows and
    products, or PyTorch only."""
    cache = DecodeCache.for_tokens(lm, tokens, slots=slots, cpu_kernel=path != "torch", kv_dtype=kv_dtype)
    decoder = Decoder(lm, cache, weights)  # type: ignore[arg-type]
    if path == "c-per-layer":
        decoder.backends.fused = None
    if path != "torch":
        assert decoder.backends.window is not None, "the C kernels did not load"
    return decoder


def _greedy(lm: ReformerLM, decoder: Decoder, prompt: torch.Tensor, steps: int,
            forced: list[int] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Each step's logits (the prefill's first) and the tokens fed: greedy, or `forced` ones."""
    first, states = prefill(lm, decoder.cache, [prompt], [prompt.shape[0] + steps + 1])
    logits, fed = [first[0]], []
    with torch.no_grad():
        for i in range(steps):
            token = forced[i] if forced is not None else int(logits[-1].argmax())
            fed.append(token)
            logits.append(decoder.step(torch.tensor([token]), states)[0])
    return logits, fed


CASES = [
    # (layers, successor heads of 2, hashes, prompt length): chunk 8, so the steps cross chunk boundaries
    (["lsh"], 2, 1, 3),
    (["lsh"], 1, 2, 16),
    (["local", "lsh"], 2, 2, 21),
    (["local", "local", "lsh"], 1, 4, 45),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layers,successor,hashes,prompt_len", CASES,
                         ids=[f"{'-'.join(c[0])}-s{c[1]}-h{c[2]}-L{c[3]}" for c in CASES])
def test_cached_decoding_equals_the_forward_over_the_prefix(layers: list[str], successor: int, hashes: int,
                                                           prompt_len: int, path: str) -> None:
    lm = _model(layers, successor, hashes)
    prompt = torch.randint(3, 258, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    steps = 20
    logits, fed = _greedy(lm, _decoder(lm, prompt_len + steps + 1, path), prompt, steps)
    seq = prompt.tolist() + fed
    with torch.no_grad():
        for i, got in enumerate(logits):
            want = lm(torch.tensor([seq[: prompt_len + i]])).logits[0, -1]
            assert (got - want).abs().max().item() <= 1e-5, i


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_the_c_paths_equal_the_pytorch_step(kernel: CpuKernels, weights: str) -> None:
    """The fused step and the per-layer C path give the same bits (each row computed alone, the same C
    functions); on float32 weights both equal the PyTorch step within rounding. Two LSH layers with
    different successor counts, so a layer's cached values feed the next one's."""
    lm = _model(["local", "lsh", "local", "lsh"], [2, 1], seed=3)
    prompt = torch.randint(3, 258, (37,), generator=torch.Generator().manual_seed(5))
    fused, tokens = _greedy(lm, _decoder(lm, 60, "fused", weights), prompt, 16)
    per_layer, _ = _greedy(lm, _decoder(lm, 60, "c-per-layer", weights), prompt, 16, forced=tokens)
    assert all(torch.equal(a, b) for a, b in zip(fused, per_layer, strict=True))
    if weights == "float32":
        plain, _ = _greedy(lm, _decoder(lm, 60, "torch"), prompt, 16, forced=tokens)
        for a, b in zip(fused, plain, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_that_can_attend_only_itself_gives_zero_in_successor_heads(path: str) -> None:
    """A request's first position (a step from an empty state) has no earlier key: its successor heads
    output exactly 0, so their value weights cannot move its logits; a plain head's can (the check can fail)."""
    lm = _model(["lsh", "local"], 1, seed=1)
    att = lm.layers[0].attention.self_attention  # type: ignore[union-attr]
    d = att.head_size

    def first_step() -> torch.Tensor:
        decoder = _decoder(lm, 8, path)
        state = decoder.cache.allocate(8)
        with torch.no_grad():
            return decoder.step(torch.tensor([7]), [state])[0]

    before = first_step()
    with torch.no_grad():
        att.value.weight[:d].mul_(3.0)  # head 0: the successor head
    assert torch.equal(first_step(), before)
    with torch.no_grad():
        att.value.weight[d:].mul_(3.0)  # head 1: a plain head, which attends itself
    assert not torch.allclose(first_step(), before)


@pytest.mark.parametrize("path", PATHS)
def test_no_step_reads_a_later_token(path: str) -> None:
    """Two requests with the same first tokens and different later ones: the logits of every step up to
    where they part are the same bits."""
    lm = _model(["local", "lsh", "local", "lsh"], [2, 1], seed=4)
    prompt = torch.randint(3, 258, (30,), generator=torch.Generator().manual_seed(6))
    a = [5, 9, 12, 40, 41, 42, 43, 44, 45, 46]
    b = a[:6] + [200, 201, 202, 203]
    got_a, _ = _greedy(lm, _decoder(lm, 48, path), prompt, len(a), forced=a)
    got_b, _ = _greedy(lm, _decoder(lm, 48, path), prompt, len(b), forced=b)
    # logits[i] is the prediction after the prompt and the first i fed tokens
    assert all(torch.equal(x, y) for x, y in zip(got_a[:7], got_b[:7], strict=True))
    assert not torch.equal(got_a[7], got_b[7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_write_puts_successor_values_where_the_pytorch_write_does(kernel: CpuKernels,
                                                                        dtype: torch.dtype) -> None:
    """Heads 0..k-1: the new value into the previous position's slot, the new slot's value 0 (for one row at
    position 0, whose previous row is its own, the value); other heads and keys as a plain write."""
    lm = _model(["local", "lsh"], 1)
    plain = DecodeCache.for_tokens(lm, 40, cpu_kernel=False, kv_dtype=dtype)
    fused = DecodeCache.for_tokens(lm, 40, kv_dtype=dtype)
    assert fused.kernel is not None and plain.kernel is None
    g = torch.Generator().manual_seed(0)
    rows, prev = torch.tensor([9, 30, 17]), torch.tensor([8, 29, 17])
    key = torch.randn(3, plain.heads, plain.head_size, generator=g)
    value = torch.randn(3, plain.heads, plain.head_size, generator=g)
    for cache in (plain, fused):
        for pool in (cache.keys[1], cache.values[1], cache.norms[1]):
            assert pool is not None
            pool[:40].fill_(7.0)  # what an earlier write left
        cache.write_step(1, rows, key, value, successor=1, prev_rows=prev)
    for cache in (plain, fused):
        values = cache.values[1]
        assert torch.equal(values[torch.tensor([9, 30]), 0], torch.zeros(2, plain.head_size, dtype=dtype))
        assert torch.equal(values[prev, 0], value[:, 0].to(dtype))
        assert torch.equal(values[rows, 1], value[:, 1].to(dtype))
        assert torch.equal(cache.keys[1][rows], key.to(dtype))
    for name in ("keys", "values", "norms"):
        a, b = getattr(plain, name)[1], getattr(fused, name)[1]
        torch.testing.assert_close(a[:40], b[:40], atol=0, rtol=1e-6 if name == "norms" else 0)
    with pytest.raises(ValueError, match="previous positions' rows"):
        fused.write_step(1, rows, key, value, successor=1)


def test_cuda_graph_steps_with_successor_heads_give_the_eager_logits() -> None:
    """CUDA graphs replay the PyTorch step (model/decoding/steps/cuda_graphs.py); on the CPU the "capture"
    calls the step again on the graph's own buffers, so the successor writes and masks must read only those."""
    from model.decoding.steps.cuda_graphs import StepGraphs

    from .test_step_graphs import _decode, _replay_by_calling

    lm = _model(["local", "lsh", "local", "lsh"], [2, 1], seed=2)
    graphs = StepGraphs(capture=_replay_by_calling)
    eager = _decode(lm, [5, 19, 33], 12, None)
    replayed = _decode(lm, [5, 19, 33], 12, graphs)
    assert graphs.replays > 0
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
