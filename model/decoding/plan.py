"""Each layer's modules as a decode step uses them, looked up once per model: a leaf module every step backend
(PyTorch, fused C, CUDA graphs) reads."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..attention import LocalSelfAttention, LSHSelfAttention

if TYPE_CHECKING:
    from ..config import ReformerConfig
    from ..reformer import ReformerLM
    from ..reversible import ReformerLayer


def layers_of(lm: ReformerLM) -> list[ReformerLayer]:
    return list(lm.layers)  # type: ignore[arg-type]



def first_lsh_layer(cfg: ReformerConfig) -> int | None:
    """The first LSH layer's index (its attention sets the window geometry every LSH layer shares), or None."""
    return next((i for i, k in enumerate(cfg.attn_layers) if k == "lsh"), None)



@dataclass(frozen=True)
class LayerPlan:
    """One layer's modules as a decode step uses them, looked up once per model instead of through
    nn.Module attribute access (about 1 us each, a dozen per layer) at every step. Kept per model (weakly):
    a model's layers are its modules for life; their weights may change (the products follow them)."""
    attention: LSHSelfAttention | LocalSelfAttention
    norm: nn.LayerNorm
    projections: tuple[nn.Linear, ...]  # LSH: query-key, value; local: query, key, value
    output: nn.Linear
    ff_norm: nn.LayerNorm
    ff_dense: nn.Linear
    ff_act: nn.Module
    ff_output: nn.Linear


_PLANS: weakref.WeakKeyDictionary[ReformerLM, list[LayerPlan]] = weakref.WeakKeyDictionary()


def layer_plan(lm: ReformerLM) -> list[LayerPlan]:
    plan = _PLANS.get(lm)
    if plan is None:
        plan = []
        for layer in layers_of(lm):
            att, ff = layer.attention.self_attention, layer.feed_forward
            if isinstance(att, LSHSelfAttention):
                projections: tuple[nn.Linear, ...] = (att.query_key, att.value)
            else:
                assert isinstance(att, LocalSelfAttention)
                projections = (att.query, att.key, att.value)
            plan.append(LayerPlan(att, layer.attention.layer_norm, projections, layer.attention.output,
                                   ff.layer_norm, ff.dense, ff.act, ff.output))
        _PLANS[lm] = plan
    return plan

