"""The dense work of a CPU decode step through the C kernel (model/kernels/csrc/step_linear.c): its matrix
products, each linear layer's weights packed once into column panels and a few rows at a time multiplied in
one pass over them; each LSH layer's hash of the new queries, its rotations packed the same way; and a
layer's tail (the attention's output projection and the feed-forward with their residual sums) in one call
over those packings (step_layers.c's step_tail, the code the one-call step runs for its tails).

A step's matrix products (projections, output projections, feed-forward, LM head) have 1-64 rows; PyTorch's
CPU matmul runs those shapes at a fraction of the core's speed (the C file says by how much). The kernel
computes each output element as one chain of fused multiply-adds in order of k, so a row's result does not
depend on what else is in the batch; it differs from F.linear's by rounding only (tests/model/
test_step_linear.py bounds it).

Layers that share their input are packed side by side and run as one product: an LSH layer's query-key and
value projections, a local layer's query, key and value. A packing is refreshed when a weight is replaced or
changed in place (its version counter moves), so a model loaded or edited after its cache was made is read
as it is now. The packings are a second copy of the step's weights (about 18 MB in float32 at
bench/decode/generate.py's config), made on a cache's first step.

`weights` (REFORMER_DECODE_WEIGHTS) is what the packings keep: float32, or bfloat16 or int8 (one float32
scale per output column; model/kernels/weights.py, csrc/step_linear_q.c), read in 2 or 1 bytes and
multiplied in float32. Only the products the kernel runs use them (the fused step's, and the per-layer
path's on one thread); the hash rotations stay float32, and where PyTorch runs a product (more threads, no
kernel) it multiplies the model's float32 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...attention import LSHSelfAttention, hash_rotations
from ...kernels import CpuKernels, abi
from ...kernels.weights import WeightKind, pack_weights


class _Packed:
    """Linear layers with one input size, their weights side by side as the kernel reads them."""

    def __init__(self, kernel: CpuKernels, layers: tuple[nn.Linear, ...], kind: WeightKind = "float32") -> None:
        # held, so the ids that key this packing cannot be reused by other layers while it exists
        self.layers = layers
        self.stamp = parameter_stamp(layers)
        weight = torch.cat([layer.weight.detach() for layer in layers]).float().contiguous()  # (N, K)
        self.n, self.k = weight.shape
        self.kind = kind
        # float32: (ceil(N / 32) * K * 32,) floats; else model/kernels/weights.py's bytes
        self.weight = kernel.pack(weight) if kind == "float32" else pack_weights(weight, kind)
        biases = [layer.bias for layer in layers]
        self.bias: Tensor | None = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(layer.out_features)
                                   for b, layer in zip(biases, layers)]).float().contiguous()
        self.weight_ptr = self.weight.data_ptr()
        self.bias_ptr = 0 if self.bias is None else self.bias.data_ptr()


def parameter_stamp(modules: tuple[nn.Module, ...] | list[nn.Module]) -> tuple[int, ...]:
    """What identifies the modules' weights as they are now: each parameter's storage and version counter
    (read from `_parameters`, not through Module.__getattr__: this runs for every step)."""
    out: list[int] = []
    for module in modules:
        for p in module._parameters.values():
            if p is not None:
                out += (p.data_ptr(), p._version)
    return tuple(out)


def act_code(act: nn.Module) -> int | None:
    """step_linear.c's code of an activation module, or None for one it does not compute."""
    if isinstance(act, nn.ReLU):
        return 0
    if isinstance(act, nn.GELU):
        return 1 if act.approximate == "none" else 2
    if isinstance(act, nn.SiLU):
        return 3
    if isinstance(act, nn.Tanh):
        return 4
    return None


def ptr(t: Tensor | None) -> int:
    """A tensor's address for the C side, 0 for none."""
    return 0 if t is None else t.data_ptr()


def norm_params(ln: nn.LayerNorm) -> tuple[int, int] | None:
    """A layer norm's weight and bias addresses as the C layer norm reads them (one-dimensional, float32,
    contiguous; 0 for a missing one), or None where it cannot."""
    if len(ln.normalized_shape) != 1:
        return None
    w, b = ln._parameters.get("weight"), ln._parameters.get("bias")
    if any(p is not None and (p.dtype != torch.float32 or not p.is_contiguous()) for p in (w, b)):
        return None
    return ptr(w), ptr(b)


class StepLinears:
    """`__call__(x, *layers)`: x (B, K) through the layers, their outputs concatenated (B, sum of N); `hash`
    and `tail` likewise. Through the C kernel for float32 CPU rows when the step runs on one intra-op thread
    (a many-core step of many rows is left to PyTorch's threaded matmul), else through PyTorch ops."""

    def __init__(self, kernel: CpuKernels | None, weights: WeightKind = "float32") -> None:
        if weights not in abi.WEIGHTS:
            raise ValueError(f"decode weights: {weights!r} is none of {', '.join(abi.WEIGHTS)}")
        self.kernel = kernel
        self.weights: WeightKind = weights
        self.weights_code = abi.WEIGHTS[weights]  # step_linear_q.c's WEIGHTS_* of the packings
        self._packed: dict[tuple[nn.Linear, ...], _Packed] = {}  # keyed by the layers themselves (by identity)
        # (id of the layer, rotation size) -> the layer (held, so its id is not reused) and (H, packed)
        self._rotations: dict[tuple[int, int], tuple[LSHSelfAttention, Tensor]] = {}

    def uses_kernel(self, x: Tensor) -> bool:
        return self.runs_kernel(x.dtype, x.device)

    def runs_kernel(self, dtype: torch.dtype, device: torch.device, threads: int | None = None) -> bool:
        """Whether products of `dtype` rows on `device` go through the kernel on `threads` intra-op threads
        (None: the count now): only on one."""
        threads = torch.get_num_threads() if threads is None else threads
        return self.kernel is not None and dtype == torch.float32 and device.type == "cpu" and threads == 1

    def __call__(self, x: Tensor, *layers: nn.Linear) -> Tensor:
        if not self.uses_kernel(x):
            return layers[0](x) if len(layers) == 1 else torch.cat([layer(x) for layer in layers], dim=-1)
        packed = self.packing(layers)
        if not x.is_contiguous():
            x = x.contiguous()
        m, k = x.shape
        if k != packed.k:
            raise ValueError(f"step linear: input of {k} features for layers of {packed.k}")
        out = torch.empty(m, packed.n, dtype=torch.float32)
        # the packing was checked when made; the call needs only the input's pointer
        assert self.kernel is not None
        if self.weights_code == abi.WEIGHTS["float32"]:
            self.kernel.linear_raw(m, packed.n, k, x.data_ptr(), k, packed.weight_ptr, packed.bias_ptr, out.data_ptr())
        elif self.kernel.linear_w_raw(self.weights_code, m, packed.n, k, x.data_ptr(), k, packed.weight_ptr,
                                      packed.bias_ptr, out.data_ptr()):
            raise ValueError(f"step linear: weights of kind {self.weights} unknown to this build")
        return out

    def norm(self, ln: nn.LayerNorm, x: Tensor) -> Tensor:
        """`ln(x)` of a step's rows x (B, n): in C where the kernel runs (the layer norm the fused step and the
        layer tails compute, so every kernel path rounds alike), else PyTorch's."""
        params = norm_params(ln)
        if params is None or not self.uses_kernel(x) or x.dim() != 2 or ln.normalized_shape[0] != x.shape[1]:
            return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        assert self.kernel is not None
        x = x if x.is_contiguous() else x.contiguous()
        out = torch.empty_like(x)
        self.kernel.norm_raw(x.shape[0], x.shape[1], x.data_ptr(), *params, ln.eps, out.data_ptr())
        return out

    def packing(self, layers: tuple[nn.Linear, ...]) -> _Packed:
        """The layers' packing, made or made again when a weight changed since (`parameter_stamp`)."""
        assert self.kernel is not None
        packed = self._packed.get(layers)
        if packed is None or packed.stamp != parameter_stamp(layers):
            packed = self._packed[layers] = _Packed(self.kernel, layers, self.weights)
        return packed

    def tail(self, att_out: Tensor, x1: Tensor, x2: Tensor, output: nn.Linear, norm: nn.LayerNorm,
             dense: nn.Linear, act: nn.Module, ff_output: nn.Linear) -> bool:
        """A layer's tail in one kernel call, in place on x1 and x2 (B, hidden), two distinct contiguous
        tensors: x1 += output(att_out); x2 += ff_output(act(dense(norm(x1)))), as the step's PyTorch ops
        compute it (the layer norm and activation in C: their rounding differs from PyTorch's, the sums and
        products are the same operations). Returns False, having done nothing, where the kernel cannot run it
        (the caller then runs those ops)."""
        code, params = act_code(act), norm_params(norm)
        if (code is None or params is None or not self.uses_kernel(x1) or not x1.is_contiguous()
                or not x2.is_contiguous() or x1.data_ptr() == x2.data_ptr()):
            return False
        assert self.kernel is not None
        m, hidden = x1.shape
        att_out = att_out if att_out.is_contiguous() else att_out.contiguous()
        packs = []
        for layer, k in ((output, att_out.shape[1]), (dense, hidden), (ff_output, dense.out_features)):
            packed = self.packing((layer,))
            if packed.k != k:
                raise ValueError(f"step tail: {k} inputs for a layer of {packed.k}")
            packs.append(packed)
        out, up, down = packs
        if out.n != hidden or down.n != hidden or up.n != down.k or att_out.shape[0] != m or x2.shape != x1.shape:
            raise ValueError(f"step tail: x1 {tuple(x1.shape)}, x2 {tuple(x2.shape)}, att {tuple(att_out.shape)}")
        status = self.kernel.tail_raw(m, hidden, out.k, up.n, att_out.data_ptr(), out.weight_ptr, out.bias_ptr,
                                   x1.data_ptr(), x2.data_ptr(), *params, norm.eps, up.weight_ptr,
                                   up.bias_ptr, code, down.weight_ptr, down.bias_ptr, self.weights_code)
        if status & abi.BAD_KIND:
            raise ValueError(f"step tail: weights of kind {self.weights} unknown to this build")
        if status:
            raise MemoryError("step tail: could not allocate its buffer")
        return True

    def hash(self, att: LSHSelfAttention, qk: Tensor, num_buckets: int | list[int]) -> Tensor:
        """`att.hash` of a step's new queries qk (B, H, D): their buckets (B, H, R), through the C kernel
        (the rotation products on the same loop as the linear layers) when `uses_kernel`."""
        if not self.uses_kernel(qk):
            return att.hash(qk.unsqueeze(2), num_buckets, None)[..., 0]
        assert self.kernel is not None
        factors = [num_buckets] if isinstance(num_buckets, int) else list(num_buckets)
        return self.kernel.lsh_hash(qk.contiguous(), self.rotations(att, sum(factors)), att.rounds, factors)

    def rotations(self, att: LSHSelfAttention, size: int) -> Tensor:
        """An LSH layer's hash rotations of `size` (the bucket count, or its factors' sum) packed per head as
        the kernel's hash reads them (H, ...), made on first use."""
        assert self.kernel is not None
        key = (id(att), size)
        held = self._rotations.get(key)
        if held is None:
            rot = hash_rotations(att.config.hash_seed, att.heads, att.head_size, att.rounds, size)  # (H, D, R, rot/2)
            per_head = rot.reshape(att.heads, att.head_size, -1).transpose(1, 2)  # (H, R*rot/2, D)
            held = self._rotations[key] = (att, torch.stack([self.kernel.pack(w.contiguous()) for w in per_head]))
        return held[1]


__all__ = ["StepLinears", "act_code", "norm_params", "parameter_stamp", "ptr"]
