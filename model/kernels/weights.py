"""A decode step's linear weights as the C products read them in bfloat16 or int8 (csrc/step_linear_q.c,
REFORMER_DECODE_WEIGHTS): `pack_weights` lays a weight (N, K) out in panels of 32 columns as that file
describes, `quantize` gives the values those panels hold, for a PyTorch reference of the same product.

bfloat16: each weight rounded to nearest even (torch's `.to(torch.bfloat16)`). int8: per output column
(a row of W), scale = max |w| / 127 and q = round(w / scale) in [-127, 127], so w ~ q * scale; a column of
zeros gets scale 0. Nothing here needs the library: the layout is plain tensor ops.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from . import abi

WeightKind = Literal["float32", "bfloat16", "int8"]
KINDS: tuple[WeightKind, ...] = ("float32", "bfloat16", "int8")


def quantize(weight: Tensor, kind: WeightKind) -> tuple[Tensor, Tensor | None]:
    """(values (N, K) float32, scale (N,) float32 or None): the weight as `kind` keeps it; the product's weight
    is values * scale[:, None] (int8), else values."""
    w = weight.detach().float()
    if kind == "float32":
        return w, None
    if kind == "bfloat16":
        return w.to(torch.bfloat16).float(), None
    if kind == "int8":
        amax = w.abs().amax(dim=1)
        scale = amax / 127.0
        q = torch.round(w / torch.where(amax > 0, scale, torch.ones_like(scale))[:, None]).clamp_(-127, 127)
        return q, scale
    raise ValueError(f"decode weights: {kind!r} is none of {', '.join(KINDS)}")


def _panels(t: Tensor, panels: int) -> Tensor:
    """t (N, K) -> (panels, K, 32): columns of t^T in panels, zero past N."""
    n, k = t.shape
    padded = torch.zeros(panels * abi.PANEL, k, dtype=t.dtype)
    padded[:n] = t
    return padded.view(panels, abi.PANEL, k).transpose(1, 2).contiguous()


def pack_weights(weight: Tensor, kind: WeightKind) -> Tensor:
    """A bfloat16 or int8 packing of weight (N, K) as step_linear_q.c reads it: a flat uint8 tensor of
    ceil(N / 32) panels (float32 packings are CpuKernels.pack's)."""
    n, k = weight.shape
    panels = -(-n // abi.PANEL)
    values, scale = quantize(weight, kind)
    if kind == "bfloat16":
        return _panels(values.to(torch.bfloat16).view(torch.int16), panels).view(torch.uint8).reshape(-1)
    if kind == "int8":
        assert scale is not None
        q = _panels(values.to(torch.int8), panels).view(torch.uint8).reshape(panels, k * abi.PANEL)
        scales = torch.zeros(panels * abi.PANEL, dtype=torch.float32)
        scales[:n] = scale
        return torch.cat([scales.view(torch.uint8).reshape(panels, 4 * abi.PANEL), q], dim=1).reshape(-1)
    raise ValueError(f"pack_weights: {kind!r} is packed by CpuKernels.pack or is unknown")


def packed_bytes(kind: WeightKind, n: int, k: int) -> int:
    """Bytes of a packing of an (n, k) weight."""
    panels = -(-n // abi.PANEL)
    return panels * {"float32": 4 * k * abi.PANEL, "bfloat16": 2 * k * abi.PANEL,
                     "int8": 4 * abi.PANEL + k * abi.PANEL}[kind]


__all__ = ["KINDS", "WeightKind", "pack_weights", "packed_bytes", "quantize"]
