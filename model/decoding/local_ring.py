"""Where the decode cache keeps a local layer's keys and values: a ring of the last `width` positions per request
slot, not a block per position.

A local layer's query at position t attends positions start .. t, start = max(0, (t // c - before) * c) (c its
chunk length, `before` its chunks before; a decoder attends none after), or 0 .. t while t is within the first
chunk: never more than width = c * (before + 1) positions, the span t - start being at most width - 1
(model/decoding/steps/torch_step.py `_local_window`, C `local_window`). So a slot keeps position p at ring row
slot * width + p mod width: the write of position t overwrites t - width, below every window from t on, and
the positions of one window land on distinct rows. A window's padding slots read position 0's row, which holds
a finite key and value written by this slot (positions 0 .. width - 1 are all written before any row is
reused, and a prefill writes its last min(length, width) positions), never uninitialised memory. The rows
depend only on the slot, so they never change when requests come and go: a local layer costs
width * (a key and a value) per slot and nothing per position."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ..attention import LocalSelfAttention
from .lsh_index import floor_mod
from .plan import layers_of

if TYPE_CHECKING:
    from ..reformer import ReformerLM


def local_window_width(lm: ReformerLM) -> int:
    """The most positions any local layer's query reads (chunk x (chunks before + 1)); 0 without local layers."""
    widths = [att.chunk * (att.before + 1) for layer in layers_of(lm)
              if isinstance(att := layer.attention.self_attention, LocalSelfAttention)]
    return max(widths, default=0)


class LocalRing:
    """Ring rows of `width` positions per slot (slot s: rows s * width .. s * width + width - 1)."""

    def __init__(self, width: int) -> None:
        if width < 0:
            raise ValueError(f"a local window ring of {width} positions")
        self.width = width

    def rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Ring rows (B, ...) of positions (B, ...) (non-negative) of the B slots `slots` (B,)."""
        base = (slots * self.width).view(-1, *([1] * (positions.dim() - 1)))  # (B, 1, ...)
        return base + floor_mod(positions, self.width)

    def kept(self, length: int) -> range:
        """The positions of a prompt of `length` the ring holds after its prefill: its last min(length, width)."""
        return range(max(length - self.width, 0), length)
