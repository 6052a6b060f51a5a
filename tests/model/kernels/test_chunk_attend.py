"""model/kernels/csrc/chunk_attend.c, the CPU's chunked LSH window attention from positions (model/fused_attention.py
takes it for float32 on the CPU when the C kernels build): the plain formulation's results (`attend` with
`attention_bias`), rows that may only see themselves rebuilt as the reference computes them, the flash
path's results, and the same bits on any thread count, for strided window views and odd sizes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from model import fused_attention
from model.chunking import attend
from model.fused_attention import CPU, fused_lsh_attend
from model.kernels import CpuKernels, abi, build, kernels
from model.lsh.masks import attention_bias
from model.lsh.windows import strided_windows


@pytest.fixture
def native() -> CpuKernels:
    kernel = kernels()
    if kernel is None:
        pytest.fail("the C kernels did not build (a compiler is part of the test environment)")
    return kernel


def _windows(b: int, h: int, n: int, c: int, d: int, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sorted sequence's chunks as the forward sees them: q (B, H, N, C, D); k, v and k_pos the previous and
    own chunk of each, as overlapping views (strided_windows); q_pos the positions; v_own the own values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, c, d, generator=g)
    keys = torch.randn(b, h, n * c, d, generator=g)
    values = torch.randn(b, h, n * c, d, generator=g)
    pos = torch.stack([torch.randperm(n * c, generator=g) for _ in range(b * h)]).view(b, h, n * c)
    k, v, k_pos = (strided_windows(x, c, 1, 0) for x in (keys, values, pos))
    return q, k, v, pos.view(b, h, n, c), k_pos, values.view(b, h, n, c, d)


@pytest.mark.parametrize(("c", "d"), [(64, 32), (8, 16), (12, 20)], ids=["shipped", "small", "odd"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_it_computes_the_plain_formulation(native: CpuKernels, c: int, d: int, causal: bool,
                                           padded: bool) -> None:
    q, k, v, q_pos, k_pos, v_own = _windows(2, 3, 4, c, d, seed=c + d)
    valid = None
    real = torch.ones_like(q_pos, dtype=torch.bool)
    if padded:
        marks = torch.rand(4 * c, generator=torch.Generator().manual_seed(1)) > 0.2
        valid, real = marks[k_pos], marks[q_pos]
    assert fused_attention._native_cpu(CPU, q) is native
    got_out, got_lse = fused_lsh_attend(q, k, v, v_own, q_pos, k_pos, valid, causal, CPU)
    want_out, want_lse = attend(q, k.contiguous(), v.contiguous(), attention_bias(q_pos, k_pos, valid, causal, True,
                                                                                  q.dtype))
    seen = (want_lse > -1e4) & real
    assert (got_out - want_out)[seen].abs().max().item() <= 1e-5
    assert (got_lse - want_lse)[seen].abs().max().item() <= 1e-5 * want_lse[seen].abs().max().item()
    alone = ~(want_lse > -1e4) & real  # the first position (causal), or every other key padding
    assert ((got_out - v_own)[alone].abs() <= 4e-3 * v_own[alone].abs() + 1e-6).all()
    if causal:
        assert bool(alone.any()), "no row saw only itself: the case is not exercised"


def test_it_gives_the_flash_paths_results(native: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, q_pos, k_pos, v_own = _windows(1, 2, 6, 64, 32, seed=3)
    got = fused_lsh_attend(q, k, v, v_own, q_pos, k_pos, None, True, CPU)
    monkeypatch.setattr(fused_attention, "_native_cpu", lambda kernel, q: None)
    flash = fused_lsh_attend(q, k, v, v_own, q_pos, k_pos, None, True, CPU)
    assert (got[0] - flash[0]).abs().max().item() <= 1e-5
    assert (got[1] - flash[1]).abs().max().item() <= 1e-5 * flash[1].abs().max().item()


def test_the_bits_do_not_depend_on_threads_layout_or_grouping(native: CpuKernels) -> None:
    q, k, v, q_pos, k_pos, _ = _windows(2, 4, 5, 64, 32, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.chunk_attend(q, k, v, q_pos, k_pos, None, "earlier", -1e9)
        torch.set_num_threads(2)
        two = native.chunk_attend(q, k, v, q_pos, k_pos, None, "earlier", -1e9)
    finally:
        torch.set_num_threads(before)
    copies = native.chunk_attend(q, k.contiguous(), v.contiguous(), q_pos, k_pos.contiguous(), None, "earlier", -1e9)
    head = native.chunk_attend(q[:, 1:2], k[:, 1:2], v[:, 1:2], q_pos[:, 1:2], k_pos[:, 1:2], None, "earlier", -1e9)
    for other in (two, copies):
        assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])
    assert torch.equal(one[0][:, 1:2], head[0]) and torch.equal(one[1][:, 1:2], head[1])


def test_it_refuses_what_it_cannot_read(native: CpuKernels) -> None:
    q, k, v, q_pos, k_pos, _ = _windows(1, 1, 2, 8, 16, seed=5)
    with pytest.raises(ValueError, match="k must be"):
        native.chunk_attend(q, k.double(), v, q_pos, k_pos, None, "earlier", -1e9)
    columns = torch.randn(1, 1, 2, 16, 8).transpose(-1, -2)  # q's shape, its rows not contiguous
    with pytest.raises(ValueError, match="q must be"):
        native.chunk_attend(columns, k, v, q_pos, k_pos, None, "earlier", -1e9)
    with pytest.raises(ValueError, match="k_pos must be"):
        native.chunk_attend(q, k, v, q_pos, k_pos[..., :-1], None, "earlier", -1e9)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_local_windows_compute_the_plain_formulation(native: CpuKernels, causal: bool,
                                                     padded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_attention.local_window_attend: a query sees the valid keys at or before it (causal) or every valid key,
    itself included; positions broadcast over heads as the local layers pass them."""
    b, h, n, c, d = 2, 4, 5, 64, 32
    g = torch.Generator().manual_seed(6)
    q = torch.randn(b, h, n, c, d, generator=g)
    keys, values = torch.randn(b, h, n * c, d, generator=g), torch.randn(b, h, n * c, d, generator=g)
    pos = torch.arange(n * c).view(1, 1, n * c).expand(b, 1, n * c)
    k, v, k_pos = (strided_windows(x, c, 1, 0) for x in (keys, values, pos))
    q_pos = pos.reshape(b, 1, n, c)
    valid = real = None
    if padded:
        marks = torch.rand(b, n * c, generator=g) > 0.2
        valid = torch.gather(marks[:, None, None, :].expand(b, 1, n, n * c), 3, k_pos)
        real = marks.view(b, 1, n, c).expand(b, h, n, c)
    rules: list[str] = []
    kernel_call = native.chunk_attend

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rules.append(args[6])
        return kernel_call(*args)

    monkeypatch.setattr(native, "chunk_attend", counted)
    with torch.no_grad():  # an eval forward's fused path (no autograd)
        got = fused_attention.local_window_attend(q, k, v, q_pos, k_pos, valid, causal)
        assert rules == ["up_to" if causal else "any"]  # the C kernel ran, with local attention's rule
        monkeypatch.setattr(fused_attention, "_native_cpu", lambda kernel, q: None)
        want = fused_attention.local_window_attend(q, k.contiguous(), v.contiguous(), q_pos, k_pos, valid, causal)
    rows = torch.ones(b, h, n, c, dtype=torch.bool) if real is None else real  # padding queries are never read
    assert (got - want)[rows].abs().max().item() <= 1e-5


def test_the_plain_loops_give_the_vector_paths_results(native: CpuKernels, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A build of chunk_attend.c's plain loops (what a CPU without AVX-512 runs; CHUNK_PLAIN_LOOPS forces
    them) against this build's (its AVX-512 paths where this CPU has them)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    target = tmp_path / "reformer_kernels-plain-loops.so"
    build.compile_library(compiler, target, ("-march=native", "-DCHUNK_PLAIN_LOOPS"))
    plain = CpuKernels(target)
    for c, d in ((64, 32), (12, 20)):
        q, k, v, q_pos, k_pos, _ = _windows(2, 3, 4, c, d, seed=7)
        for rule in abi.CHUNK_RULES:
            want, got = (kernel.chunk_attend(q, k, v, q_pos, k_pos, None, rule, -1e9) for kernel in (native, plain))
            assert (got[0] - want[0]).abs().max().item() <= 1e-5
            assert (got[1] - want[1]).abs().max().item() <= 1e-5 * want[1].abs().max().item()


def test_a_model_can_be_kept_off_the_c_kernel(native: CpuKernels,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_attention.use_c_kernels (the service's REFORMER_CPU_KERNELS): a model kept off it computes what the
    flash path computes, bit for bit, and says so (c_kernel_runs)."""
    from model import ReformerLM

    from ..helpers import tiny_config

    torch.manual_seed(8)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["local", "lsh"])).eval()
    ids = torch.randint(3, 258, (1, 100))
    with torch.no_grad():
        on = lm(ids).logits
        assert fused_attention.c_kernel_runs(lm)
        fused_attention.use_c_kernels(lm, False)
        off = lm(ids).logits
        assert not fused_attention.c_kernel_runs(lm)
        monkeypatch.setattr(fused_attention, "_native_cpu", lambda kernel, q: None)
        flash = lm(ids).logits
    assert torch.equal(off, flash) and not torch.equal(on, off)
    assert (on - off).abs().max().item() <= 1e-4
