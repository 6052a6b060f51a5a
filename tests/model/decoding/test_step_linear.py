"""The C linear layers of a CPU decode step (model/kernels/csrc/step_linear.c, model/decoding/steps/linear.py): the
product
against float64, a row's bits independent of the batch, packings refreshed when weights change, the PyTorch
fallback, and whole decodes through it against decodes without it."""

from __future__ import annotations

import copy
import ctypes
import gc
import shutil
import subprocess
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from model.decoding.steps.linear import StepLinears
from model.kernels import CpuKernels, build

from ..helpers import tiny_config

# one intra-op thread, as a decode step of a few rows runs (tests/model/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("n", "k"), [(1024, 256), (256, 1024), (258, 512), (33, 17), (7, 3), (32, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_product_matches_float64(kernel: CpuKernels, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = kernel.pack(w)
    for m in (1, 5, 8, 9, 20):
        x = torch.randn(m, k, generator=g)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        out = kernel.linear(x, packed, n, b)
        assert out.shape == (m, n)
        # float32 sums of k products: the error grows with sqrt(k) times the products' size
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=2e-6 * k**0.5), (out.double() - ref).abs().max()


def test_a_rows_bits_do_not_depend_on_the_batch(kernel: CpuKernels) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    packed = kernel.pack(w)
    x = torch.randn(19, 96, generator=g)  # two full tiles of 8 rows and a remainder of 3
    batched = kernel.linear(x, packed, 300, b)
    alone = torch.cat([kernel.linear(x[i : i + 1], packed, 300, b) for i in range(19)])
    assert torch.equal(batched, alone)
    order = torch.randperm(19, generator=g)
    assert torch.equal(kernel.linear(x[order].contiguous(), packed, 300, b), batched[order])


def test_the_kernel_refuses_mismatched_shapes(kernel: CpuKernels) -> None:
    packed = kernel.pack(torch.randn(64, 32))
    with pytest.raises(ValueError, match="linear kernel"):
        kernel.linear(torch.randn(2, 32), packed, 65, None)  # a packing for 64 outputs
    with pytest.raises(ValueError, match="linear kernel"):
        kernel.linear(torch.randn(2, 32), packed, 64, torch.randn(63))
    with pytest.raises(ValueError, match="linear kernel"):
        kernel.linear(torch.randn(2, 32, dtype=torch.float64), packed, 64, None)


def test_layers_side_by_side_give_each_layers_bits(kernel: CpuKernels) -> None:
    torch.manual_seed(2)
    a, b, c = nn.Linear(64, 96, bias=False), nn.Linear(64, 40), nn.Linear(64, 64)
    linears = StepLinears(kernel)
    x = torch.randn(6, 64)
    fused = linears(x, a, b, c)
    assert torch.equal(fused, torch.cat([linears(x, a), linears(x, b), linears(x, c)], dim=-1))
    with torch.no_grad():
        assert torch.allclose(fused, torch.cat([a(x), b(x), c(x)], dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match="input of 63 features"):
        linears(torch.randn(2, 63), a)


def test_a_packing_follows_weights_changed_after_it(kernel: CpuKernels) -> None:
    torch.manual_seed(3)
    layer = nn.Linear(32, 48)
    linears = StepLinears(kernel)
    x = torch.randn(3, 32)
    assert linears.uses_kernel(x)  # the products below are the kernel's, not the layer's own
    first = linears(x, layer)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the version counter moves
        assert torch.allclose(linears(x, layer), layer(x), atol=1e-5)
        layer.load_state_dict({"weight": torch.randn(48, 32), "bias": torch.randn(48)})
        assert torch.allclose(linears(x, layer), layer(x), atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(48, 32))  # a new tensor
        assert torch.allclose(linears(x, layer), layer(x), atol=1e-5)
        assert not torch.allclose(linears(x, layer), first, atol=1e-3)


def test_without_the_kernel_the_layers_run_themselves(kernel: CpuKernels) -> None:
    torch.manual_seed(4)
    a, b = nn.Linear(16, 8), nn.Linear(16, 24)
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = torch.cat([a(x), b(x)], dim=-1)
        assert torch.equal(StepLinears(None)(x, a, b), want)
        a64, b64 = nn.Linear(16, 8).double(), nn.Linear(16, 24).double()  # float64: not the kernel's
        assert torch.equal(StepLinears(kernel)(x.double(), a64, b64), torch.cat([a64(x.double()), b64(x.double())], -1))
        torch.set_num_threads(2)  # a threaded step is left to PyTorch's matmul
        assert torch.equal(StepLinears(kernel)(x, a, b), torch.cat([a(x), b(x)], dim=-1))


def _decode(lm: ReformerLM, prompts: list[torch.Tensor], steps: int, kernel_linears: bool
            ) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens and logits of each step, and how many kernel calls (products, layer tails) the steps ran,
    on the per-layer path (the step in one call, tests/model/test_step_fused.py, makes none of those calls)."""
    cache = DecodeCache(lm, 64 << 20, max_slots=len(prompts))
    decoder = Decoder(lm, cache)
    decoder.backends.fused = None
    calls = 0
    if kernel_linears:
        assert decoder.backends.linears.kernel is not None
        kernel = decoder.backends.linears.kernel = copy.copy(decoder.backends.linears.kernel)

        def counting(fn: object) -> object:
            def counted(*args: object) -> int:
                nonlocal calls
                calls += 1
                return fn(*args)  # type: ignore[operator]
            return counted

        kernel.linear_raw, kernel.tail_raw = counting(kernel.linear_raw), counting(kernel.tail_raw)
    else:
        decoder.backends.linears = StepLinears(None)
    first, states = prefill(lm, cache, prompts, [p.shape[0] + steps + 1 for p in prompts])
    token, tokens, logits = first.argmax(-1), [], []
    for _ in range(steps):
        out = decoder.step(token, states)
        logits.append(out)
        token = out.argmax(-1)
        tokens.append(token.tolist())
    return tokens, logits, calls


@pytest.mark.parametrize("layers", [["lsh", "local"], ["local", "lsh", "local"]])
def test_a_decode_through_the_kernel_matches_one_through_pytorch(layers: list[str]) -> None:
    torch.manual_seed(5)
    lm = ReformerLM(tiny_config(attn_layers=layers, num_hashes=2)).eval()
    prompts = [torch.randint(3, lm.config.vocab_size, (n,)) for n in (5, 37, 20)]
    with torch.no_grad():
        fast, fast_logits, calls = _decode(lm, prompts, 12, True)
        slow, slow_logits, _ = _decode(lm, prompts, 12, False)
    # per step and layer: the attention's projections (one product) and the layer's tail (its output
    # projection and feed-forward in one call); and the LM head
    assert calls == 12 * (2 * len(layers) + 1)
    assert fast == slow
    for a, b in zip(fast_logits, slow_logits):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("no", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")])
def test_the_builds_without_avx512_or_avx2_give_the_same_bits(kernel: CpuKernels, tmp_path: Path,
                                                              no: tuple[str, ...]) -> None:
    """The AVX2 loop (CPUs without AVX-512) and the plain-C one (without AVX2 either) run the same chains of
    multiply-adds as the build this CPU loads."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    lib_path = tmp_path / "step_linear_plain.so"
    source = next(src for src in build.SOURCES if src.name == "step_linear.c")
    subprocess.run([compiler, *build.COMMON_FLAGS, "-march=native", "-shared", *no, str(source), "-o",
                    str(lib_path)], check=True)
    plain = CpuKernels.__new__(CpuKernels)
    lib = ctypes.CDLL(str(lib_path))
    plain.linear_raw, plain._pack = lib.step_linear, lib.step_linear_pack
    plain.linear_raw.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
    plain._pack.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    g = torch.Generator().manual_seed(6)
    w, b, x = torch.randn(70, 48, generator=g), torch.randn(70, generator=g), torch.randn(11, 48, generator=g)
    assert torch.equal(plain.pack(w), kernel.pack(w))
    assert torch.equal(plain.linear(x, plain.pack(w), 70, b), kernel.linear(x, kernel.pack(w), 70, b))


@pytest.mark.parametrize("num_buckets", [8, 64, [4, 8]])
def test_the_hash_kernel_gives_the_attentions_buckets(num_buckets: int | list[int]) -> None:
    torch.manual_seed(7)
    lm = ReformerLM(tiny_config(attn_layers=["lsh"], num_hashes=3, num_buckets=None)).eval()
    att = lm.layers[0].attention.self_attention
    linears = Decoder(lm, DecodeCache(lm, 8 << 20, max_slots=1)).backends.linears
    assert linears.kernel is not None
    for rows in (1, 3, 8, 13):
        qk = torch.randn(rows, att.heads, att.head_size)
        qk[0, 0] = 0.0  # every rotated value 0: ties resolve to the first index, x before -x
        att.c_kernel = False  # PyTorch's bucket choice (tested against the C one below)
        want = att.hash(qk.unsqueeze(2), num_buckets, None)[..., 0]  # (B, H, R)
        att.c_kernel = True
        with mock.patch.object(att, "hash", side_effect=AssertionError("the PyTorch hash ran")):
            got = linears.hash(att, qk, num_buckets)  # through the kernel, not att.hash
        assert got.dtype == torch.int64 and torch.equal(got, want)
        assert torch.equal(got[1:2], linears.hash(att, qk[1:2], num_buckets))  # alone as batched


@pytest.mark.parametrize("num_buckets", [8, 64, [4, 8], [2, 16, 4], [32, 64]])
def test_a_forwards_bucket_choice_in_c_is_pytorchs(num_buckets: int | list[int]) -> None:
    torch.manual_seed(8)
    lm = ReformerLM(tiny_config(attn_layers=["lsh"], num_hashes=3, num_buckets=None)).eval()
    att = lm.layers[0].attention.self_attention
    qk = torch.randn(2, att.heads, 37, att.head_size)
    qk[0, 0, :5] = 0.0  # rotated values all 0: ties go to the first index, x before -x
    qk[0, 1, 5] = float("nan")
    qk[1, 0, 6] = float("inf")
    qk[1, 1, 7, 0] = -float("inf")
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[1, 30:] = False
    att.c_kernel = False
    want = [att.hash(qk, num_buckets, v) for v in (None, valid)]
    att.c_kernel = True
    calls = []
    real = CpuKernels.lsh_buckets

    def spy(self: CpuKernels, rotated: torch.Tensor, factors: list[int]) -> torch.Tensor:
        calls.append(tuple(rotated.shape))
        return real(self, rotated, factors)

    with mock.patch.object(CpuKernels, "lsh_buckets", spy):
        got = [att.hash(qk, num_buckets, v) for v in (None, valid)]
    assert len(calls) == 2  # the C pass ran
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int64 and g.shape == (2, att.heads, 3, 37) and torch.equal(g, w)


def test_a_packing_is_never_taken_for_another_layer(kernel: CpuKernels) -> None:
    """Packings are keyed by the layers' ids; each holds its layers (a packing's layer outlives every other
    reference to it), so a layer made later cannot take a packed layer's id and so its packing."""
    linears = StepLinears(kernel)
    x = torch.randn(2, 16)
    refs = []
    for seed in range(5):
        torch.manual_seed(seed)
        layer = nn.Linear(16, 16)
        with torch.no_grad():
            assert torch.allclose(linears(x, layer), layer(x), atol=1e-5)
        refs.append(weakref.ref(layer))
        del layer
    gc.collect()
    assert all(ref() is not None for ref in refs)
    lm = ReformerLM(tiny_config(attn_layers=["lsh"], num_buckets=8)).eval()
    att = weakref.ref(lm.layers[0].attention.self_attention)
    linears.hash(lm.layers[0].attention.self_attention, torch.randn(1, 2, 16), 8)
    del lm
    gc.collect()
    assert att() is not None


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Tanh()])
def test_a_layers_tail_in_one_call_matches_its_ops(kernel: CpuKernels, act: nn.Module) -> None:
    torch.manual_seed(8)
    output, norm = nn.Linear(24, 32, bias=False), nn.LayerNorm(32)
    dense, ff_output = nn.Linear(32, 48), nn.Linear(48, 32)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
        att, x1, x2 = torch.randn(5, 24), torch.randn(5, 32), torch.randn(5, 32)
        want1 = x1 + output(att)
        want2 = x2 + ff_output(act(dense(norm(want1))))
        linears = StepLinears(kernel)
        got1, got2 = x1.clone(), x2.clone()
        assert linears.tail(att, got1, got2, output, norm, dense, act, ff_output)
        torch.testing.assert_close(got1, want1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got2, want2, atol=1e-5, rtol=1e-5)
        # a row's bits alone as batched
        one1, one2 = x1[2:3].clone(), x2[2:3].clone()
        assert linears.tail(att[2:3].contiguous(), one1, one2, output, norm, dense, act, ff_output)
        assert torch.equal(one1, got1[2:3]) and torch.equal(one2, got2[2:3])
        # what it does not take: aliased halves, an activation it has no code for, no kernel
        same = x1.clone()
        assert not linears.tail(att, same, same, output, norm, dense, act, ff_output)
        assert not linears.tail(att, x1.clone(), x2.clone(), output, norm, dense, nn.Softplus(), ff_output)
        assert not StepLinears(None).tail(att, x1.clone(), x2.clone(), output, norm, dense, act, ff_output)
        assert torch.equal(same, x1)  # refused calls leave their inputs alone
