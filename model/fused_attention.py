"""The eval-time inner loop of chunked LSH attention through fused kernels, which also return the
log-sum-exp the hash-round combination needs: on CPU in float32 the C kernel model/kernels/csrc/chunk_attend.c
(it works the masks out from the positions: no bias is built) where the C kernels build, else PyTorch's
flash kernel; the memory-efficient kernel (it takes an additive bias) on CUDA. Local attention's chunk
windows take the C kernel too (`local_window_attend`). The training path (model/chunking.py `attend`) is
the plain formulation; all match the reference (tests/model/test_chunk_attend.py for the C kernel).

Only the kernel call differs by device. The bias (padded to the kernel's alignment), the reshape to the
kernels' (B, H, L, D) layout, the log-sum-exp unpacking and the rows that may only see themselves are
shared, so `reference_kernel` (plain softmax, held to the CUDA kernel's input contract) stands in for the
CUDA kernel in the CPU tests. The kernel is chosen by the query's device and dtype at call time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .chunking import attend, fusable
from .kernels import kernels
from .lsh.masks import attention_bias, mask_value, self_mask_value

# (q (B, H, L, D), k and v (B, H, K, D), bias (B, H, L, K) in q's dtype) -> (out (B, H, L, D), fp32 raw
# log-sum-exp (B, H, L') with L' >= L: the CUDA kernel pads it to a multiple of 32)
KernelFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class FusedKernel:
    name: str
    run: KernelFn
    dtypes: tuple[torch.dtype, ...]
    bias_alignment: int  # the bias's row stride must be a multiple of this many elements
    sparse_self_rows: bool = False  # rebuild self-only rows by index (a host sync: CPU only)


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=1.0)
    return out, lse


def _cuda_efficient(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=1.0)
    return out, lse


# The CUDA kernel's attention rows per block; its log-sum-exp has a multiple of this many rows.
CUDA_LSE_ALIGNMENT = 32


def reference_kernel(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Plain softmax in the CUDA kernel's place: refuses inputs the CUDA kernel refuses (its checks on the
    layout, the bias dtype and the bias alignment), accumulates in fp32 as it does, and returns the
    log-sum-exp padded as it does (padding filled with NaN, so a caller that reads it fails tests)."""
    if q.dim() != 4 or k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise RuntimeError(f"expected (B, H, L, D) q and (B, H, K, D) k, v; got {q.shape}, {k.shape}, {v.shape}")
    if bias.dtype != q.dtype:
        raise RuntimeError("invalid dtype for bias - should match query's dtype")
    if bias.shape != (*q.shape[:3], k.shape[2]):
        raise RuntimeError(f"attn_bias: wrong shape {tuple(bias.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, bias)):
        raise RuntimeError("last dimension must be contiguous")
    align = CUDA.bias_alignment
    if any(s % align for s in bias.stride()[:3]) or bias.data_ptr() % (align * bias.element_size()):
        raise RuntimeError(f"attn_bias is not correctly aligned: strides {bias.stride()}")
    dots = torch.matmul(q.float(), k.float().transpose(-1, -2)) + bias.float()  # (B, H, L, K)
    lse = torch.logsumexp(dots, dim=-1)  # (B, H, L)
    out = torch.matmul(torch.exp(dots - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    rows = -(-q.shape[2] // CUDA_LSE_ALIGNMENT) * CUDA_LSE_ALIGNMENT
    padded = lse.new_full((*lse.shape[:2], rows), float("nan"))
    padded[..., : q.shape[2]] = lse
    return out, padded


CPU = FusedKernel("cpu_flash", _cpu_flash, (torch.float32, torch.bfloat16), bias_alignment=1,
                  sparse_self_rows=True)
# 16 elements: the memory-efficient kernel needs the bias rows aligned to 128 bits (4 fp32, 8 bf16/fp16
# elements), and torch's own SDPA front end pads its masks to 16 for it.
CUDA = FusedKernel("cuda_efficient", _cuda_efficient, (torch.float32, torch.bfloat16, torch.float16),
                    bias_alignment=16)
REFERENCE = FusedKernel("reference", reference_kernel, CUDA.dtypes, CUDA.bias_alignment)
KERNELS = {"cpu": CPU, "cuda": CUDA}


def window_kernel_for(q: Tensor, fusable: bool) -> FusedKernel | None:
    """The fused kernel for q's device and dtype, or None (the plain path). `fusable`: the forward may
    fuse at all (chunking.can_fuse's conditions other than the device: eval, no autograd, no tracing)."""
    kernel = KERNELS.get(q.device.type)
    return kernel if fusable and kernel is not None and q.dtype in kernel.dtypes else None


def fused_lsh_attend(q: Tensor, k: Tensor, v: Tensor, v_own: Tensor, q_pos: Tensor, k_pos: Tensor,
                     k_valid: Tensor | None, causal: bool, kernel: FusedKernel = CPU, c_kernel: bool = True,
                     *, successor: bool = False) -> tuple[Tensor, Tensor]:
    """q, v_own (B, H, N, C, D); k, v (B, H, N, W*C, D); q_pos (B, H, N, C); k_pos, k_valid (B, H, N, W*C).
    v_own holds each query's own value. `c_kernel`: the C kernel may run in the CPU kernel's place.
    Returns (output (B, H, N, C, D) in q's dtype, log-sum-exp (B, H, N, C) in fp32) as the reference
    computes them.

    A query's own position is masked outright here. In the reference it gets the logit -1e5 instead,
    which contributes nothing (exp(-1e5) = 0) unless the query sees nothing else. Those rows (the first
    token, or a token alone with later tokens in its window) come out of the kernel fully masked and are
    rebuilt below exactly as the reference computes them.

    `successor` (successor-value heads, model/lsh/successor.py): only earlier keys are allowed whatever
    `causal` says, and rows that see no key are left as the kernel returns them (their log-sum-exp is about
    the mask value; the caller zeroes them)."""
    if successor:
        causal = True
    b, h, n, c, d = q.shape
    native = _native_cpu(kernel, q) if c_kernel else None
    if native is not None:  # the masks from the positions, no bias (model/kernels/csrc/chunk_attend.c)
        out, lse = native.chunk_attend(q, k, v, q_pos, k_pos, k_valid, "earlier" if causal else "other",
                                       mask_value(q.dtype))
        if successor:
            return out, lse
        return _attend_to_self(out, lse, q_pos, k_pos, v_own, kernel.sparse_self_rows)
    bias = window_bias(q_pos, k_pos, k_valid, causal, q.dtype, kernel.bias_alignment)  # (B*H, N, C, W*C)
    out, lse = kernel.run(q.reshape(b * h, n, c, d), _merge_batch_heads(k), _merge_batch_heads(v), bias)
    out = out.reshape(b, h, n, c, d)  # (B, H, N, C, D)
    lse = lse[..., :c].reshape(b, h, n, c)  # the kernel's rows past C are padding
    if successor:
        return out, lse
    return _attend_to_self(out, lse, q_pos, k_pos, v_own, kernel.sparse_self_rows)


def local_window_attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None,
                        causal: bool, dropout: float = 0.0, generator: torch.Generator | None = None,
                        fused: bool = True, c_kernel: bool = True) -> Tensor:
    """Local attention over chunk windows: q (B, H, N, C, D), k and v (B, H, N, W*C, D), q_pos (B, 1|H, N, C),
    k_pos and k_valid (B, 1|H, N, W*C) -> (B, H, N, C, D). A query sees the valid keys at or before it
    (causal) or every valid key, itself included. A float32 eval forward on the CPU takes the C kernel
    (model/kernels/csrc/chunk_attend.c: the masks from the positions, no bias); elsewhere `attend` with
    `attention_bias` (training, dropout, tracing, other dtypes and devices)."""
    native = _native_cpu(CPU, q) if c_kernel and fusable(dropout, fused) else None
    if native is not None:
        b, h = q.shape[:2]
        qp, kp = q_pos.expand(b, h, *q_pos.shape[2:]), k_pos.expand(b, h, *k_pos.shape[2:])
        kv = None if k_valid is None else k_valid.expand(b, h, *k_valid.shape[2:])
        out, _ = native.chunk_attend(q, k, v, qp, kp, kv, "up_to" if causal else "any", mask_value(q.dtype))
        return out  # type: ignore[no-any-return]
    bias = attention_bias(q_pos, k_pos, k_valid, causal, False, q.dtype)  # (B, 1|H, N, C, W*C)
    out, _ = attend(q, k, v, bias, dropout, generator, fused=fused)
    return out


def use_c_kernels(model: torch.nn.Module, enabled: bool) -> None:
    """Whether the model's attention layers may attend their chunk windows through the C kernel (the
    service's REFORMER_CPU_KERNELS): set on the modules, so it holds for every user of this model object."""
    for module in model.modules():
        if hasattr(module, "c_kernel"):
            setattr(module, "c_kernel", enabled)  # noqa: B010  (nn.Module types its attributes as tensors)


def c_kernel_runs(model: torch.nn.Module) -> bool:
    """Whether a float32 CPU forward of the model attends its chunk windows in C now."""
    layers = [m for m in model.modules() if hasattr(m, "c_kernel")]
    param = next(model.parameters(), None)  # the model's dtype and device, what its queries will have
    return bool(layers) and all(m.c_kernel for m in layers) and param is not None and \
        _native_cpu(CPU, param) is not None


def _native_cpu(kernel: FusedKernel, q: Tensor) -> Any:
    """The C kernels (model/kernels/) for a float32 query on the CPU kernel's path, else None (bf16,
    CUDA, the reference kernel, or no C build: REFORMER_CPU_KERNELS=off or no build)."""
    if kernel is not CPU or q.dtype != torch.float32 or not q.is_cpu:
        return None
    return kernels()


def native_kernels(x: Tensor) -> Any:
    """The C kernels (model/kernels/) for a forward's work on float32 CPU tensors beside the window
    attention (its hash's bucket choice, a prefill's bucket sort), else None (an export's trace or a compile
    keeps PyTorch's ops)."""
    if x.dtype != torch.float32 or not x.is_cpu or torch.jit.is_tracing() \
            or torch.compiler.is_compiling():
        return None
    return kernels()


def window_bias(q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None, causal: bool, dtype: torch.dtype,
                alignment: int) -> Tensor:
    """q_pos (B, H, N, C), k_pos and k_valid (B, H, N, W*C) -> additive bias (B*H, N, C, W*C): 0 where the
    key is allowed, the mask value at the query's own position, later positions (causal) and padding. Rows
    are laid out `alignment` elements apart (a view into a padded buffer)."""
    qp = q_pos.unsqueeze(-1)
    kp = k_pos.unsqueeze(-2)
    allowed = (kp < qp) if causal else (kp != qp)  # (B, H, N, C, W*C)
    if k_valid is not None:
        allowed = allowed & k_valid.unsqueeze(-2)
    b, h, n, c, w = allowed.shape
    zero = torch.zeros((), dtype=dtype, device=q_pos.device)
    neg = torch.full((), mask_value(dtype), dtype=dtype, device=q_pos.device)
    if alignment == 1:
        return torch.where(allowed, zero, neg).view(b * h, n, c, w)
    padded = -(-w // alignment) * alignment
    bias = torch.empty(b * h, n, c, padded, dtype=dtype, device=q_pos.device)[..., :w]  # (B*H, N, C, W*C)
    torch.where(allowed.view(b * h, n, c, w), zero, neg, out=bias)
    return bias


def _merge_batch_heads(x: Tensor) -> Tensor:
    """(B, H, N, K, D) -> (B*H, N, K, D), as a view when H == 1 (x may be overlapping strided windows)."""
    if x.shape[1] == 1:
        return x.select(1, 0)
    return x.reshape(-1, *x.shape[2:])


def _attend_to_self(out: Tensor, lse: Tensor, q_pos: Tensor, k_pos: Tensor, v_own: Tensor, sparse: bool
                    ) -> tuple[Tensor, Tensor]:
    """Rows that may only see their own position, which the window can hold several times (once per hash
    round it wraps into). The reference gives each copy the logit -1e5 and normalises by an fp32
    log-sum-exp, so the row's output is count*exp(-1e5 - lse)*v_self with lse = -1e5 + log(count).
    `sparse` (CPU): find the few rows and rebuild only them. Otherwise rebuild with `where` over all rows,
    which costs a window-sized comparison but no host sync (CUDA)."""
    alone = lse < 0.5 * mask_value(out.dtype)  # (B, H, N, C): the kernel saw only masked keys
    if sparse:
        if not bool(alone.any()):
            return out, lse
        bi, hi, ni, ci = alone.nonzero(as_tuple=True)
        own = q_pos[bi, hi, ni, ci]  # (M,)
        count = (k_pos[bi, hi, ni] == own.unsqueeze(-1)).sum(-1)  # (M,)
        row_out, row_lse = _self_rows(count, v_own[bi, hi, ni, ci], lse.dtype)
        out[bi, hi, ni, ci] = row_out
        lse[bi, hi, ni, ci] = row_lse
        return out, lse
    count = (k_pos.unsqueeze(-2) == q_pos.unsqueeze(-1)).sum(-1)  # (B, H, N, C)
    row_out, row_lse = _self_rows(count, v_own, lse.dtype)
    return torch.where(alone.unsqueeze(-1), row_out, out), torch.where(alone, row_lse, lse)


def _self_rows(count: Tensor, v_self: Tensor, lse_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """count (...) copies of the own position, v_self (..., D) -> (output (..., D) in v's dtype, lse (...))."""
    c = count.clamp(min=1).to(lse_dtype)
    self_value = self_mask_value(v_self.dtype)
    row_lse = torch.log(c) + self_value
    return ((c * torch.exp(self_value - row_lse)).unsqueeze(-1) * v_self).to(v_self.dtype), row_lse
