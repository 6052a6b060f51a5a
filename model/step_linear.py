"""The matrix products of a CPU decode step through the C kernel (model/kernels/step_linear.c): each linear
layer's weights packed once into column panels, a few rows at a time multiplied in one pass over them; and
each LSH layer's hash of the new queries, its rotations packed the same way.

A step's matrix products (projections, output projections, feed-forward, LM head) have 1-64 rows; PyTorch's
CPU matmul runs those shapes at a fraction of the core's speed (the C file says by how much). The kernel
computes each output element as one chain of fused multiply-adds in order of k, so a row's result does not
depend on what else is in the batch; it differs from F.linear's by rounding only (tests/model/
test_step_linear.py bounds it).

Layers that share their input are packed side by side and run as one product: an LSH layer's query-key and
value projections, a local layer's query, key and value. A packing is refreshed when a weight is replaced or
changed in place (its version counter moves), so a model loaded or edited after its cache was made is read
as it is now. The packings are a second float32 copy of the step's weights (about 18 MB at bench/generate.py's
config), made on a cache's first step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import LSHSelfAttention, hash_rotations
from .cpu_kernels import WindowKernel


class _Packed:
    """Linear layers with one input size, their weights side by side as the kernel reads them."""

    def __init__(self, kernel: WindowKernel, layers: tuple[nn.Linear, ...]) -> None:
        # held, so the ids that key this packing cannot be reused by other layers while it exists
        self.layers = layers
        self.stamp = _stamp(layers)
        weight = torch.cat([layer.weight.detach() for layer in layers]).float().contiguous()  # (N, K)
        self.n, self.k = weight.shape
        self.weight = kernel.pack(weight)  # (ceil(N / 32) * K * 32,)
        biases = [layer.bias for layer in layers]
        self.bias: Tensor | None = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(layer.out_features)
                                   for b, layer in zip(biases, layers)]).float().contiguous()
        self.weight_ptr = self.weight.data_ptr()
        self.bias_ptr = 0 if self.bias is None else self.bias.data_ptr()


def _stamp(layers: tuple[nn.Linear, ...]) -> tuple[int, ...]:
    """What identifies the weights' current values: each tensor's storage and version counter (read from
    `_parameters`, not through Module.__getattr__: this runs for every product of every step)."""
    out: list[int] = []
    for layer in layers:
        for p in layer._parameters.values():
            if p is not None:
                out += (p.data_ptr(), p._version)
    return tuple(out)


class StepLinears:
    """`__call__(x, *layers)`: x (B, K) through the layers, their outputs concatenated (B, sum of N). Through
    the C kernel for float32 CPU rows when the step runs on one intra-op thread (a many-core step of many
    rows is left to PyTorch's threaded matmul), else through the layers themselves."""

    def __init__(self, kernel: WindowKernel | None) -> None:
        self.kernel = kernel
        self._packed: dict[tuple[nn.Linear, ...], _Packed] = {}  # keyed by the layers themselves (by identity)
        # (id of the layer, rotation size) -> the layer (held, so its id is not reused) and (H, packed)
        self._rotations: dict[tuple[int, int], tuple[LSHSelfAttention, Tensor]] = {}

    def uses_kernel(self, x: Tensor) -> bool:
        return self.kernel is not None and x.dtype == torch.float32 and x.is_cpu and torch.get_num_threads() == 1

    def runs_kernel(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether products of `dtype` rows on `device` go through the kernel now (the intra-op thread count
        is part of the rule)."""
        return (self.kernel is not None and dtype == torch.float32 and device.type == "cpu"
                and torch.get_num_threads() == 1)

    def __call__(self, x: Tensor, *layers: nn.Linear) -> Tensor:
        if not self.uses_kernel(x):
            return layers[0](x) if len(layers) == 1 else torch.cat([layer(x) for layer in layers], dim=-1)
        assert self.kernel is not None
        packed = self._packed.get(layers)
        if packed is None or packed.stamp != _stamp(layers):
            packed = self._packed[layers] = _Packed(self.kernel, layers)
        if not x.is_contiguous():
            x = x.contiguous()
        m, k = x.shape
        if k != packed.k:
            raise ValueError(f"step linear: input of {k} features for layers of {packed.k}")
        out = torch.empty(m, packed.n, dtype=torch.float32)
        # the packing was checked when made; the call needs only the input's pointer
        self.kernel._linear(m, packed.n, k, x.data_ptr(), k, packed.weight_ptr, packed.bias_ptr, out.data_ptr())
        return out

    def hash(self, att: LSHSelfAttention, qk: Tensor, num_buckets: int | list[int]) -> Tensor:
        """`att.hash` of a step's new queries qk (B, H, D): their buckets (B, H, R), through the C kernel
        (the rotation products on the same loop as the linear layers) when `uses_kernel`."""
        if not self.uses_kernel(qk):
            return att.hash(qk.unsqueeze(2), num_buckets, None)[..., 0]
        assert self.kernel is not None
        factors = [num_buckets] if isinstance(num_buckets, int) else list(num_buckets)
        size = sum(factors)  # the rotations' size: the count, or its factors' sum
        key = (id(att), size)
        held = self._rotations.get(key)
        if held is None:
            rot = hash_rotations(att.config.hash_seed, att.heads, att.head_size, att.rounds, size)  # (H, D, R, rot/2)
            per_head = rot.reshape(att.heads, att.head_size, -1).transpose(1, 2)  # (H, R*rot/2, D)
            held = self._rotations[key] = (att, torch.stack([self.kernel.pack(w.contiguous()) for w in per_head]))
        packed = held[1]
        return self.kernel.lsh_hash(qk.contiguous(), packed, att.rounds, factors)


__all__ = ["StepLinears"]
