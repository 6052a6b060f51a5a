"""A CPU decode step's layers in one C call (model/decoding/steps/fused.py, model/kernels/csrc/step_layers.c): the
same bits as
the per-layer kernel path, the cache left as that path leaves it, and the per-layer path wherever the one call
does not apply."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, DecodeState, prefill
from model.decoding.steps.fused import FusedStep
from model.decoding.steps.linear import StepLinears
from model.kernels import CpuKernels, abi, build

from ..helpers import tiny_config

# one intra-op thread, as a decode step of a few rows runs (tests/model/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


class _Counting(FusedStep):
    """FusedStep counting the steps it ran (not the ones it left to the per-layer path)."""

    def __init__(self, fused: FusedStep) -> None:
        super().__init__(fused.linears)
        self.ran = 0
        self.rows: list[int] = []  # the rows of each call it ran

    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]  # noqa: ANN002, ANN003, ANN201
        out = super().run(*args, **kwargs)
        self.ran += out is not None
        if out is not None:
            self.rows.append(len(args[3]))  # run(lm, cache, window, tokens, ...)
        return out


def _decode(lm: ReformerLM, prompts: list[torch.Tensor], steps: int, fused: bool, join_at: dict[int, int] | None = None,
            setup: Callable[[Decoder], None] | None = None
            ) -> tuple[list[list[torch.Tensor]], DecodeCache, list[DecodeState], int]:
    """Greedy decoding of the prompts in one batch (prompt i joining after join_at[i] steps; `setup` edits the
    decoder first); each request's logits per step, the cache and states after, and how many steps ran in one
    call."""
    cache = DecodeCache.for_tokens(lm, 256, slots=len(prompts))
    decoder = Decoder(lm, cache)
    if setup is not None:
        setup(decoder)
    counting = _Counting(decoder.backends.fused) if fused and decoder.backends.fused is not None else None
    decoder.backends.fused = counting
    join_at = join_at or {}
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    states: dict[int, DecodeState] = {}
    logits: dict[int, torch.Tensor] = {}
    total = steps + max(join_at.values(), default=0)
    with torch.no_grad():
        for step in range(total):
            for i, p in enumerate(prompts):
                if join_at.get(i, 0) == step:
                    first, (states[i],) = prefill(lm, cache, [p], [p.shape[0] + total])
                    logits[i] = first[0]
            order = sorted(states)
            tokens = torch.stack([logits[i].argmax() for i in order])
            new = decoder.step(tokens, [states[i] for i in order])
            for k, i in enumerate(order):
                logits[i] = new[k]
                out[i].append(new[k])
    return out, cache, [states[i] for i in sorted(states)], 0 if counting is None else counting.ran


@pytest.mark.parametrize(("layers", "buckets", "axial"), [
    (["local", "lsh", "local", "lsh"], 4, True), (["lsh", "lsh", "lsh"], None, True), (["local", "local"], 4, False),
    (["lsh", "local"], [2, 2], True)])
def test_the_step_in_one_call_gives_the_bits_of_the_per_layer_path(kernel: CpuKernels,
                                                                    layers: list[str], buckets: object,
                                                                    axial: bool) -> None:
    """Mixed prompt lengths (short rows attending densely, rows hashing), requests joining, recent orders
    merged (steps past RECENT), fixed, automatic (rows of different counts in one step) and factored bucket
    counts: every step's logits, and what the cache holds after (each request's keys, values and key
    factors, the LSH orders and counts), are the per-layer path's, bit for bit."""
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, attn_layers=layers, num_buckets=buckets,
                                hidden_act="gelu", axial_pos_embds=axial)).eval()
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 33, 64, 20, 90)]
    join = {2: 3, 4: 6}
    one, c1, s1, ran = _decode(lm, prompts, 70, True, join)
    per_layer, c2, s2, _ = _decode(lm, prompts, 70, False, join)
    assert ran == 70 + 6  # every step ran in one call
    for a, b in zip(one, per_layer, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert [(s.slot, s.length) for s in s1] == [(s.slot, s.length) for s in s2]
    for li in range(len(layers)):
        for s in s1:  # the pool rows each request holds (the same in both caches: allocation is deterministic)
            rows = c1.held_rows(li, s)
            assert torch.equal(c1.keys[li][rows], c2.keys[li][rows])
            assert torch.equal(c1.values[li][rows], c2.values[li][rows])
            norms1, norms2 = c1.norms[li], c2.norms[li]
            if norms1 is not None and norms2 is not None:
                assert torch.equal(norms1[rows], norms2[rows])
            i1, i2 = c1.indexes[li], c2.indexes[li]
            if i1 is not None and i2 is not None:
                assert torch.equal(i1.main_counts[s.slot], i2.main_counts[s.slot])
                assert torch.equal(i1.recent_counts[s.slot], i2.recent_counts[s.slot])
                assert torch.equal(i1.recent[s.slot], i2.recent[s.slot])
                main = int(i1.main_counts[s.slot, 0, 0].sum())  # positions in the main order
                assert torch.equal(i1.order[rows[:main]], i2.order[rows[:main]])


def test_a_step_in_one_call_holds_only_the_batch_rows(kernel: CpuKernels) -> None:
    """No padding rows up to a batch bucket (rows are computed alone, so the call needs none): 3 and then 5
    requests make calls of 3 and 5 rows, not 4 and 8."""
    torch.manual_seed(2)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["local", "lsh"], num_buckets=4)).eval()
    prompts = [torch.randint(3, 258, (n,)) for n in (5, 40, 70, 9, 66)]
    cache = DecodeCache.for_tokens(lm, 128, slots=5)
    decoder = Decoder(lm, cache)
    assert decoder.backends.fused is not None
    counting = decoder.backends.fused = _Counting(decoder.backends.fused)
    with torch.no_grad():
        first, states = prefill(lm, cache, prompts[:3], [80] * 3)
        logits = decoder.step(first.argmax(-1), states)
        more, joined = prefill(lm, cache, prompts[3:], [80] * 2)
        decoder.step(torch.cat([logits.argmax(-1), more.argmax(-1)]), [*states, *joined])
    assert counting.rows == [3, 5]


def test_a_batched_step_in_one_call_gives_each_row_its_bits_alone(kernel: CpuKernels) -> None:
    torch.manual_seed(1)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, attn_layers=["local", "lsh"], num_buckets=4)
                    ).eval()
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 41, 66)]
    together, _, _, ran = _decode(lm, prompts, 12, True)
    assert ran == 12
    for i, p in enumerate(prompts):
        alone, _, _, _ = _decode(lm, [p], 12, True)
        assert all(torch.equal(x, y) for x, y in zip(together[i], alone[0], strict=True))


def test_the_step_on_two_threads_gives_the_bits_of_one(kernel: CpuKernels) -> None:
    """The products split by panels and the attention by (row, head) between two OpenMP threads."""
    torch.manual_seed(6)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, attn_layers=["local", "lsh", "lsh"],
                                num_buckets=None, hidden_act="gelu")).eval()
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 33, 64, 90)]
    one, _, _, ran_one = _decode(lm, prompts, 20, True, {1: 2})
    torch.set_num_threads(2)
    two, _, _, ran_two = _decode(lm, prompts, 20, True, {1: 2})
    assert ran_one == ran_two == 22
    for a, b in zip(one, two, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_one_call_path_matches_pytorch(kernel: CpuKernels) -> None:
    """Against the PyTorch path (no C kernels at all): the same greedy tokens, logits within rounding."""
    torch.manual_seed(2)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, attn_layers=["local", "lsh", "lsh"],
                                num_buckets=4)).eval()
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 50)]
    one, _, _, ran = _decode(lm, prompts, 20, True)
    assert ran == 20
    cache = DecodeCache.for_tokens(lm, 160, slots=2, cpu_kernel=False)
    decoder = Decoder(lm, cache)
    assert decoder.backends.fused is None and cache.kernel is None
    with torch.no_grad():
        first, states = prefill(lm, cache, prompts, [80, 80])
        token = first.argmax(-1)
        for step in range(20):
            logits = decoder.step(token, states)
            for i in range(2):
                assert torch.allclose(logits[i], one[i][step], atol=1e-4), step
            token = logits.argmax(-1)


def test_weights_changed_after_a_step_are_read_as_they_are_now(kernel: CpuKernels) -> None:
    torch.manual_seed(3)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["lsh", "local"], num_buckets=4)).eval()
    prompt = torch.randint(3, 258, (40,))
    cache = DecodeCache.for_tokens(lm, 160, slots=1)
    decoder = Decoder(lm, cache)
    with torch.no_grad():
        first, (state,) = prefill(lm, cache, [prompt], [60])
        decoder.step(first.argmax(-1), [state])
        layer = lm.layers[1]
        layer.feed_forward.dense.weight.mul_(2.0)  # type: ignore[union-attr,operator]
        layer.attention.layer_norm.bias.add_(0.5)  # type: ignore[union-attr,operator]
        lm.final_layer_norm.weight.mul_(0.5)
        before = {i: (cache.keys[i].clone(), cache.values[i].clone()) for i in range(2)}
        fused = decoder.backends.fused
        assert fused is not None
        token = torch.tensor([5])
        got = decoder.step(token, [state])
        # the same step on the per-layer path, from the cache as it was
        for i, (k, v) in before.items():
            cache.keys[i].copy_(k)
            cache.values[i].copy_(v)
        state.length -= 1
        index = cache.indexes[0]
        assert index is not None
        decoder.backends.fused = None
        recent = [t.clone() for t in index.tensors()]
        _undo_append(cache, state, recent)
        want = decoder.step(token, [state])
    assert torch.equal(got, want)


def _undo_append(cache: DecodeCache, state: DecodeState, recent: list[torch.Tensor]) -> None:
    """Take the last step's position out of the LSH layer's recent order (it is the last item of its
    bucket; the step appended exactly one item per head and round)."""
    index = cache.indexes[0]
    assert index is not None
    counts = index.recent_counts[state.slot]  # (H, R, NB)
    items = index.recent[state.slot]  # (H, R, RECENT)
    stored = int(index.store(torch.tensor([state.length]))[0])
    for h in range(counts.shape[0]):
        for r in range(counts.shape[1]):
            n = int(counts[h, r].sum())
            at = [j for j in range(n) if int(items[h, r, j]) == stored]
            assert len(at) == 1
            j = at[0]
            bucket = int(torch.searchsorted(counts[h, r].cumsum(0), j, right=True))
            items[h, r, j : n - 1] = items[h, r, j + 1 : n].clone()
            items[h, r, n - 1] = index.shift
            counts[h, r, bucket] -= 1


def test_it_leaves_to_the_per_layer_path_what_it_cannot_run(kernel: CpuKernels) -> None:
    torch.manual_seed(4)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["lsh", "local"], num_buckets=4)).eval()
    prompt = torch.randint(3, 258, (30,))
    cache = DecodeCache.for_tokens(lm, 160, slots=2)
    decoder = Decoder(lm, cache)
    fused = decoder.backends.fused
    assert fused is not None
    tokens = [5]
    meta = [[0] * 7]
    with torch.no_grad():
        prefill(lm, cache, [prompt], [50])
        # an activation the C side does not compute
        lm.layers[0].feed_forward.act = nn.Softplus()  # type: ignore[union-attr]
        assert fused.run(lm, cache, decoder.backends.window, tokens, meta, [(4, None)]) is None


def test_a_row_token_or_position_outside_the_tables_is_refused_leaving_the_cache(
        kernel: CpuKernels) -> None:
    torch.manual_seed(5)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["lsh", "local"], num_buckets=4)).eval()
    cache = DecodeCache.for_tokens(lm, 160, slots=1)
    decoder = Decoder(lm, cache)
    fused = decoder.backends.fused
    assert fused is not None
    with torch.no_grad():
        _, (state,) = prefill(lm, cache, [torch.randint(3, 258, (20,))], [60])
    before = [t.clone() for t in (*cache.keys, *cache.values)]  # compared as bits: unwritten rows may hold NaN
    good = [state.slot, state.length, 1, 1, 0, state.slot, 1]
    outside = lm.config.max_position_embeddings
    for tokens, row in [(5, [cache.block_table.shape[0] + 3, *good[1:]]), (258, good), (-1, good),
                        (5, [good[0], outside, *good[2:]])]:
        with pytest.raises(IndexError, match="outside the decode cache"):
            fused.run(lm, cache, decoder.backends.window, [tokens], [row], [])
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(before, (*cache.keys, *cache.values), strict=True))


def test_the_layer_description_has_the_c_side_layout(kernel: CpuKernels) -> None:
    assert kernel.layer_words * 8 == ctypes.sizeof(abi.StepLayer)
    assert kernel.embedding_words * 8 == ctypes.sizeof(abi.StepEmbedding)


def test_a_compiler_without_openmp_builds_a_step_that_gives_the_same_bits(kernel: CpuKernels,
                                                                           tmp_path: Path) -> None:
    """build.compile_library retries without -fopenmp when the compiler refuses it (a compiler without OpenMP);
    that build runs the step on one thread, with the bits of the OpenMP build at any thread count."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    fake = tmp_path / "cc-without-openmp"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{build.OPENMP}" ] && exit 1; done\n'
                    f'exec {compiler} "$@"\n')
    fake.chmod(0o755)
    target = tmp_path / "built" / "reformer_kernels-plain.so"
    build.compile_library(str(fake), target, ("-march=native",))
    assert b"GOMP_parallel" not in target.read_bytes()
    plain = CpuKernels(target)
    torch.manual_seed(7)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, attn_layers=["local", "lsh"],
                                num_buckets=4)).eval()
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 40)]
    want, _, _, _ = _decode(lm, prompts, 8, True)

    def with_plain(decoder: Decoder) -> None:
        decoder.cache.kernel = decoder.backends.window = plain
        decoder.backends.linears = StepLinears(plain)
        decoder.backends.fused = FusedStep(decoder.backends.linears)

    torch.set_num_threads(2)
    got, _, _, ran = _decode(lm, prompts, 8, True, setup=with_plain)
    assert ran == 8
    for a, b in zip(want, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
