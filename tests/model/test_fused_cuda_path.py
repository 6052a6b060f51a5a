"""The fused chunk-window path as CUDA runs it, on CPU: model/fused_attention.py shares everything but the kernel
call (bias padded to the CUDA kernel's alignment, (B, H, L, D) layout, log-sum-exp unpacking, rows that
see only themselves), and `reference_kernel` (plain softmax held to the CUDA kernel's input contract)
stands in for torch's memory-efficient CUDA kernel. The last test runs the real kernel where CUDA exists."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model import ReformerLM, fused_attention
from model.attention import LocalSelfAttention
from model.chunking import attend
from model.fused_attention import (
    CPU,
    CUDA,
    REFERENCE,
    fused_lsh_attend,
    reference_kernel,
    window_bias,
    window_kernel_for,
)
from model.lsh.masks import attention_bias, mask_value

from .helpers import random_ids, tiny_config

CASES = [
    ("causal", {}, 64),
    ("causal-4-rounds", {"num_hashes": 4}, 72),
    ("factorised", {"num_buckets": [2, 4], "num_hashes": 3}, 96),
    ("chunk-16", {"lsh_attn_chunk_length": 16, "local_attn_chunk_length": 8}, 80),
    ("before-2", {"lsh_num_chunks_before": 2}, 64),
    ("bidirectional", {"is_decoder": False, "lsh_num_chunks_after": 1, "local_num_chunks_after": 1}, 64),
]


def _pair(seed: int = 0, **overrides: Any) -> tuple[ReformerLM, ReformerLM]:
    torch.manual_seed(seed)
    fused = ReformerLM(tiny_config(**overrides)).eval()
    plain = ReformerLM(tiny_config(**overrides), fused_attention=False).eval()
    plain.load_state_dict(fused.state_dict())
    for module in fused.modules():  # local layers keep the plain path: only the LSH window kernel differs
        if isinstance(module, LocalSelfAttention):
            module.fused = False
    return fused, plain


@pytest.fixture
def reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route CPU tensors to the reference kernel (CUDA's contract) and count its calls."""
    calls: list[int] = []

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return reference_kernel(*args)

    monkeypatch.setitem(fused_attention.KERNELS, "cpu", fused_attention.FusedKernel("counted", counted,
                                                                                     REFERENCE.dtypes,
                                                                          REFERENCE.bias_alignment))
    return calls


@pytest.mark.parametrize("name,overrides,length", CASES, ids=[c[0] for c in CASES])
def test_cuda_layout_equals_unfused_path(reference_on_cpu: list[int], name: str, overrides: dict, length: int) -> None:
    fused, plain = _pair(**overrides)
    ids = random_ids(2, length)
    mask = torch.ones_like(ids)
    mask[1, length - 13:] = 0  # a padded row: its windows go through the gather layout, not strided views
    with torch.no_grad():
        for m in (None, mask):
            a, b = fused(ids, m), plain(ids, m)
            real = torch.ones_like(ids, dtype=torch.bool) if m is None else m.bool()  # padding is never read
            assert (a.logits - b.logits)[real].abs().max().item() <= 1e-5
            assert (a.hidden_states - b.hidden_states)[real].abs().max().item() <= 1e-5
    assert reference_on_cpu, "the reference kernel never ran"


def test_window_attention_with_rows_that_see_only_themselves() -> None:
    """Direct comparison with `attend`, positions wrapping across rounds so a window holds a position twice."""
    g = torch.Generator().manual_seed(0)
    b, h, n, c, d, w = 2, 1, 4, 8, 16, 2
    q = torch.randn(b, h, n, c, d, generator=g)
    k = torch.randn(b, h, n, w * c, d, generator=g)
    v = torch.randn(b, h, n, w * c, d, generator=g)
    q_pos = torch.randperm(n * c, generator=g).view(1, 1, n, c).expand(b, h, n, c).contiguous()
    k_pos = torch.cat([q_pos.roll(1, dims=2), q_pos], dim=-1)  # previous chunk, then its own (B, H, N, W*C)
    k_pos[:, :, 1, :c] = q_pos[:, :, 1]  # chunk 1's window holds every own position twice
    v_own = torch.randn(b, h, n, c, d, generator=g)
    v[:, :, :, c:] = v_own  # the own chunk's values are the queries' own values
    v[:, :, 1, :c] = v_own[:, :, 1]
    valid_pos = torch.rand(n * c, generator=g) > 0.2  # padding positions, as the model marks them
    k_valid = valid_pos[k_pos]  # (B, H, N, W*C)
    real = valid_pos[q_pos]  # outputs at padding positions are never read
    for causal in (True, False):
        for valid in (None, k_valid):
            rows = real if valid is not None else torch.ones_like(real)
            bias = attention_bias(q_pos, k_pos, valid, causal, True, q.dtype)
            want_out, want_lse = attend(q, k, v, bias)
            got_out, got_lse = fused_lsh_attend(q, k, v, v_own, q_pos, k_pos, valid, causal, REFERENCE)
            seen = (want_lse > -1e4) & rows
            assert (got_out - want_out)[seen].abs().max().item() <= 1e-5
            assert (got_lse[seen] - want_lse[seen]).abs().max().item() <= 1e-5 * want_lse[seen].abs().max().item()
            # a row that sees only itself (its own position once or twice) gets its own value, through
            # logits of -1e5 whose fp32 spacing (2**-7) bounds the rounding of both paths at 0.4%; its lse is
            # -1e5 + log(count) here, where the plain path adds q.k (see attention_bias): either gives the
            # round no weight beside a round that sees something
            alone = ~(want_lse > -1e4) & rows
            assert ((got_out - v_own)[alone].abs() <= 4e-3 * v_own[alone].abs() + 1e-6).all()
            assert ((want_out - v_own)[alone].abs() <= 4e-3 * v_own[alone].abs() + 1e-6).all()
            assert bool(((got_lse[alone] + 1e5).abs() <= 0.7).all())
            if causal:
                assert bool(alone.any()), "no row saw only itself: the case is not exercised"


def test_bias_rows_are_aligned_for_the_cuda_kernel() -> None:
    g = torch.Generator().manual_seed(1)
    q_pos = torch.randint(0, 50, (2, 1, 3, 8), generator=g)
    k_pos = torch.randint(0, 50, (2, 1, 3, 24), generator=g)  # 24 keys: not a multiple of 16
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        plain = window_bias(q_pos, k_pos, None, True, dtype, alignment=1)
        aligned = window_bias(q_pos, k_pos, None, True, dtype, alignment=16)
        assert torch.equal(plain, aligned)
        assert aligned.stride()[:3] == (3 * 8 * 32, 8 * 32, 32) and aligned.stride(-1) == 1
        neg = torch.tensor(mask_value(dtype), dtype=dtype).item()
        assert set(plain.unique().tolist()) == {0.0, neg} and torch.isfinite(plain).all()


def test_reference_kernel_refuses_what_the_cuda_kernel_refuses() -> None:
    q = torch.randn(2, 3, 8, 16)
    k = torch.randn(2, 3, 24, 16)
    misaligned = torch.zeros(2, 3, 8, 24)
    with pytest.raises(RuntimeError, match="aligned"):
        reference_kernel(q, k, k, misaligned)
    with pytest.raises(RuntimeError, match="dtype"):
        reference_kernel(q, k, k, torch.zeros(2, 3, 8, 32, dtype=torch.bfloat16)[..., :24])
    out, lse = reference_kernel(q, k, k, torch.zeros(2, 3, 8, 32)[..., :24])
    assert out.shape == q.shape and lse.shape == (2, 3, 32) and bool(lse[..., 8:].isnan().all())


def test_cuda_kernel_call_matches_its_meta_signature() -> None:
    """torch's meta implementation of the CUDA kernel checks our call (argument order, scale keyword) and
    gives its output shapes: the log-sum-exp comes padded to 32 rows and the shared code unpacks it."""
    b, h, n, c, d = 1, 1, 6, 8, 16
    bf16 = torch.bfloat16
    q = torch.empty(b, h, n, c, d, device="meta", dtype=bf16)
    k = torch.empty(b, h, n, 2 * c, d, device="meta", dtype=bf16)
    q_pos = torch.empty(b, h, n, c, device="meta", dtype=torch.long)
    k_pos = torch.empty(b, h, n, 2 * c, device="meta", dtype=torch.long)
    raw_out, raw_lse = CUDA.run(q[:, 0], k[:, 0], k[:, 0], torch.empty(b, n, c, 2 * c, device="meta", dtype=bf16))
    assert raw_out.shape == (b, n, c, d) and raw_lse.shape == (b, n, 32) and raw_lse.dtype == torch.float32
    out, lse = fused_lsh_attend(q, k, k, q, q_pos, k_pos, None, True, CUDA)
    assert out.shape == q.shape and lse.shape == (b, h, n, c)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_kernel_is_chosen_by_device_and_dtype() -> None:
    x = torch.zeros(1)
    assert window_kernel_for(x, True) is CPU
    assert window_kernel_for(x.bfloat16(), True) is CPU
    assert window_kernel_for(x.half(), True) is None  # the CPU flash kernel is not used in fp16
    assert window_kernel_for(x, False) is None
    assert fused_attention.KERNELS["cuda"] is CUDA and torch.float16 in CUDA.dtypes
    assert window_kernel_for(torch.zeros(1, device="meta"), True) is None


NEEDS_CUDA = "needs CUDA: on a GPU host, pytest tests/model/test_fused_cuda_path.py -k cuda (gpu_check.sh does not)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_equals_unfused_on_cuda(dtype: torch.dtype) -> None:
    fused, plain = _pair(num_hashes=4, lsh_attn_chunk_length=16, local_attn_chunk_length=16)
    fused, plain = fused.to("cuda", dtype), plain.to("cuda", dtype)
    ids = random_ids(2, 256).cuda()
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    with torch.no_grad():
        for m in (None, mask):
            a, b = fused(ids, m).logits.float(), plain(ids, m).logits.float()
            assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
