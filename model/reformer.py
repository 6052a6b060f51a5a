"""ReformerLM: embeddings, reversible LSH/local layers, final layer norm, LM head; embeddings by pooling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import AttentionContext
from .config import ReformerConfig
from .embeddings import AxialPositionEmbeddings, ReformerEmbeddings
from .reversible import ReformerLayer, run_layers


@dataclass
class ReformerOutput:
    logits: Tensor  # (B, L, vocab)
    hidden_states: Tensor  # (B, L, 2*hidden), after the final layer norm


class ReformerLM(nn.Module):
    def __init__(self, config: ReformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ReformerEmbeddings(config)
        self.layers = nn.ModuleList([ReformerLayer(kind, config) for kind in config.attn_layers])
        self.final_layer_norm = nn.LayerNorm(2 * config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(2 * config.hidden_size, config.vocab_size)
        # training uses the memory-saving reversible backward; tests compare it with plain autograd
        self.reversible = True
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, AxialPositionEmbeddings):
            for w in module.weights:
                nn.init.normal_(w, std=self.config.axial_norm_std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ----------------------------------------------------------------------------------------------
    def _prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, AttentionContext, int]:
        """Pad the batch to a chunk multiple and work out each row's own padded length."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        cfg = self.config
        device = input_ids.device
        padded = cfg.padded_length(t)
        if padded > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence of {t} tokens (padded to {padded}) exceeds max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        valid: Tensor | None = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError("attention_mask must have the shape of input_ids")
            valid = attention_mask.to(torch.bool)
            pos = torch.arange(t, device=device)
            own = torch.where(valid, pos + 1, torch.zeros_like(pos)).amax(dim=1)  # last real position + 1
            if bool(valid.all()):
                valid = None
        else:
            own = torch.full((b,), t, dtype=torch.long, device=device)
        if padded != t:
            input_ids = F.pad(input_ids, (0, padded - t), value=cfg.pad_token_id)
            base = valid if valid is not None else torch.ones(b, t, dtype=torch.bool, device=device)
            valid = F.pad(base, (0, padded - t), value=False)
        own_padded = _own_padded_lengths(own, cfg)
        return input_ids, AttentionContext(valid=valid, own_length=own_padded), t

    def hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_offset: int = 0) -> Tensor:
        """Final hidden states (B, L, 2*hidden) for the real length L (padding removed). `position_offset`
        shifts the position embeddings (training uses random offsets so every axial row is trained)."""
        ids, ctx, t = self._prepare(input_ids, attention_mask)
        x = self.embeddings(ids, start=position_offset)  # (B, L', hidden)
        seeds = self._layer_seeds() if self.training else None
        y1, y2 = run_layers(self.layers, x, x, ctx, seeds, self.reversible)
        h = self.final_layer_norm(torch.cat([y1, y2], dim=-1))  # (B, L', 2*hidden)
        h = F.dropout(h, self.config.hidden_dropout_prob, self.training)
        return h[:, :t]

    def _layer_seeds(self) -> list[tuple[int, int]] | None:
        cfg = self.config
        if max(cfg.hidden_dropout_prob, cfg.lsh_attention_probs_dropout_prob,
               cfg.local_attention_probs_dropout_prob) <= 0.0:
            return [(0, 0)] * len(self.layers)
        # drawn from the global generator, so a seeded training run is reproducible
        draws = torch.randint(0, 2**62, (len(self.layers), 2)).tolist()
        return [(int(a), int(b)) for a, b in draws]

    def head(self, hidden: Tensor) -> Tensor:
        chunk = self.config.chunk_size_lm_head
        if chunk <= 0 or hidden.shape[1] <= chunk:
            return self.lm_head(hidden)
        return torch.cat([self.lm_head(part) for part in hidden.split(chunk, dim=1)], dim=1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_offset: int = 0) -> ReformerOutput:
        h = self.hidden(input_ids, attention_mask, position_offset)
        return ReformerOutput(logits=self.head(h), hidden_states=h)

    @torch.no_grad()
    def embed(self, input_ids: Tensor, attention_mask: Tensor | None = None, pooling: str = "mean",
              normalize: bool = False) -> Tensor:
        """Pooled final hidden states (B, 2*hidden): mean over real tokens, or the last real token."""
        h = self.hidden(input_ids, attention_mask)
        return pool_hidden(h, attention_mask, pooling, normalize)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_model: Any) -> ReformerLM:
        """From a `transformers` ReformerModelWithLMHead: same weights, same function."""
        from .hf import hf_state_dict_to_ours

        lm = cls(ReformerConfig.from_hf(hf_model.config))
        lm.load_state_dict(hf_state_dict_to_ours(hf_model.state_dict()))
        return lm.eval()

    # incremental decoding (prefill / decode_step) lives in decode.py
    def prefill(self, input_ids: Tensor) -> tuple[Tensor, Any]:
        from .decode import prefill

        return prefill(self, input_ids)

    def decode_step(self, token_ids: Tensor, states: list[Any]) -> Tensor:
        from .decode import decode_step

        return decode_step(self, token_ids, states)


def pool_hidden(h: Tensor, attention_mask: Tensor | None, pooling: str, normalize: bool) -> Tensor:
    b, t, _ = h.shape
    mask = (torch.ones(b, t, device=h.device) if attention_mask is None
            else attention_mask.to(h.dtype))  # (B, L)
    if pooling == "mean":
        vec = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    elif pooling == "last":
        pos = torch.arange(t, device=h.device)
        last = torch.where(mask > 0, pos, torch.zeros_like(pos)).amax(dim=1)  # (B,)
        vec = h[torch.arange(b, device=h.device), last]
    else:
        raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
    return F.normalize(vec, dim=-1) if normalize else vec


def _own_padded_lengths(own: Tensor, cfg: ReformerConfig) -> Tensor:
    """Each row's length as the reference pads it when run alone (ReformerConfig.padded_length), in
    tensor ops so that export traces it."""
    lengths = cfg.chunk_lengths()
    lcm = math.lcm(*lengths)
    keep = (own % lcm == 0) | (own <= min(lengths))
    return torch.where(keep, own, (own + lcm - 1) // lcm * lcm)
