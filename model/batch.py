"""Batch preparation: the one place that turns a caller's (input_ids, attention_mask) into what the layers
run on, used by the eager forward, the static (ONNX) forward and prefill.

Supported masks: each row's real tokens (mask != 0) form one contiguous run; anything before the run is
left padding, anything after it right padding, and a row may have both. Positions are counted from each
row's first real token (as `transformers` does with position ids), so a row's real tokens get exactly the
result of that row alone. A mask with a hole (a 0 between real tokens) is refused with
`InvalidAttentionMask` (a ValueError) that names the row (`check_attention_mask`).

How: every row's real run is shifted to the start (a per-row gather), the batch is padded to a chunk
multiple, and each row gets its own padded length (what the reference pads that row to alone). The
layers see a right-padded batch; `PreparedBatch.restore` gathers their output back into the caller's
layout. Output at padding positions is unspecified (left padding repeats the first real token's row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import AttentionContext
from .config import ReformerConfig


class InvalidAttentionMask(ValueError):
    """A mask the model does not support (a 0 between real tokens, or a wrong shape): the service answers
    it with 422, as any invalid request."""


@dataclass
class PreparedBatch:
    input_ids: Tensor  # (B, L') real tokens of each row first, then pad_token_id; L' a padded length
    valid: Tensor | None  # (B, L') bool, True at real tokens (None: no padding anywhere, eager only)
    own_length: Tensor  # (B,) each row's own padded length, as the reference pads that row alone
    length: Tensor  # (B,) real tokens per row
    shift: Tensor | None  # (B,) index of each row's first real token (None: no row starts with padding)
    t: int  # the caller's length L

    @property
    def context(self) -> AttentionContext:
        return AttentionContext(valid=self.valid, own_length=self.own_length)

    def restore(self, x: Tensor) -> Tensor:
        """x (B, L', *rest) in the prepared layout -> (B, L, *rest) in the caller's layout."""
        x = x[:, : self.t]
        if self.shift is None:
            return x
        pos = torch.arange(self.t, device=x.device)
        back = torch.clamp(pos.unsqueeze(0) - self.shift.unsqueeze(1), min=0)  # (B, L)
        idx = back.view(*back.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        return torch.gather(x, 1, idx)


def own_padded_lengths(own: Tensor, config: ReformerConfig) -> Tensor:
    """Each row's length as the reference pads it when run alone (ReformerConfig.padded_length), in tensor
    ops so that export traces it. own (B,) real lengths -> (B,)."""
    lengths = config.chunk_lengths()
    lcm = math.lcm(*lengths)
    keep = (own % lcm == 0) | (own <= min(lengths))
    return torch.where(keep, own, (own + lcm - 1) // lcm * lcm)


def mask_runs(attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B, L) mask -> (first real index, real count, last real index + 1), each (B,); 0s for empty rows."""
    valid = attention_mask != 0
    pos = torch.arange(valid.shape[1], device=valid.device)
    big = torch.full_like(pos, valid.shape[1])
    first = torch.where(valid, pos, big).amin(dim=1)
    end = torch.where(valid, pos + 1, torch.zeros_like(pos)).amax(dim=1)
    count = valid.sum(dim=1)
    return torch.where(count > 0, first, torch.zeros_like(first)), count, end


def check_attention_mask(attention_mask: Tensor) -> None:
    """Refuse a mask whose real tokens are not one contiguous run per row (a 0 between two 1s)."""
    if attention_mask.dim() != 2:
        raise InvalidAttentionMask(f"attention_mask must be (batch, length), got shape {tuple(attention_mask.shape)}")
    first, count, end = mask_runs(attention_mask)
    holes = ((end - first) != count).nonzero().flatten().tolist()
    if holes:
        raise InvalidAttentionMask(
            f"attention_mask row {holes[0]} has padding between real tokens; each row's real tokens must be "
            "one contiguous run (left and/or right padding only)")


def prepare_batch(input_ids: Tensor, attention_mask: Tensor | None, config: ReformerConfig, *,
                  static: bool = False) -> PreparedBatch:
    """(B, L) ids and optional mask -> the layers' right-padded, chunk-padded batch.

    Eager (`static=False`): checks the mask (InvalidAttentionMask on holes), pads to `config.padded_length(L)`, and
    skips the shift and the mask when the data needs neither. Static (`static=True`, the ONNX graph):
    no data-dependent branches and no check (the caller of the graph checks the mask), padding to a
    multiple of the chunk lengths' least common multiple so the exporter can prove its reshapes valid."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    device = input_ids.device
    if static:
        multiple = math.lcm(*config.chunk_lengths())
        padded = (t + multiple - 1) // multiple * multiple
    else:
        padded = config.padded_length(t)
        if padded > config.max_position_embeddings:
            raise ValueError(f"sequence of {t} tokens (padded to {padded}) exceeds max_position_embeddings "
                             f"{config.max_position_embeddings}")
    if attention_mask is None:
        if static:
            attention_mask = torch.ones_like(input_ids)
        else:
            own = torch.full((b,), t, dtype=torch.long, device=device)
            ids = F.pad(input_ids, (0, padded - t), value=config.pad_token_id)
            tail = None if padded == t else (torch.arange(padded, device=device) < t).expand(b, padded)
            return PreparedBatch(ids, tail, own_padded_lengths(own, config), own, None, t)
    if attention_mask.shape != input_ids.shape:
        raise InvalidAttentionMask("attention_mask must have the shape of input_ids")
    if not static:
        check_attention_mask(attention_mask)
    first, count, _ = mask_runs(attention_mask)
    pos = torch.arange(t, device=device)
    shift: Tensor | None = first
    if static or bool((first > 0).any()):
        src = torch.clamp(pos.unsqueeze(0) + first.unsqueeze(1), max=t - 1)  # (B, L)
        ids = torch.gather(input_ids, 1, src)
    else:
        shift, ids = None, input_ids
    valid_t = pos.unsqueeze(0) < count.unsqueeze(1)  # (B, L)
    ids = torch.where(valid_t, ids, torch.full_like(ids, config.pad_token_id))
    ids = F.pad(ids, (0, padded - t), value=config.pad_token_id)  # (B, L')
    valid: Tensor | None = F.pad(valid_t, (0, padded - t), value=False)  # (B, L')
    if not static and padded == t and bool(valid_t.all()):
        valid = None
    return PreparedBatch(ids, valid, own_padded_lengths(count, config), count, shift, t)
